"""Ray and Serve start-up for the cluster: loopback defaults, the engine deployment, `serve --cluster`.

Ray's defaults are changed only where they matter to us: usage stats off (`RAY_USAGE_STATS_ENABLED=0`),
a local instance bound to 127.0.0.1, no dashboard, and Serve's own HTTP proxy off (the gateway is the
front; 8000 is streamsvc's port). Everything else (membership, placement of replicas on GPUs, health
checks, replacement of a dead replica, draining) is Ray's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, replace

from models.parallel import PARALLEL_ENV, parallel_env
from streamsvc.cluster.replica import EngineReplica, ReplicaConfig
from streamsvc.viewers.server import ServerConfig

log = logging.getLogger("streamsvc.cluster")

APP = "streamsvc"  # the Serve application
DEPLOYMENT = "engine"  # its one deployment: an engine per GPU


@dataclass(frozen=True)
class DeployConfig:
    replicas: int = 1  # engine replicas, one per GPU (--parallel K: one per group of K GPUs)
    num_gpus: float = 1.0  # GPUs per replica (--parallel K: K, its ranks' devices)
    num_cpus: float = 1.0  # CPU cores Ray reserves per replica
    drain_timeout_s: float = 60.0  # Serve's graceful_shutdown_timeout_s: a stopping replica's streams play this long
    health_period_s: float = 2.0  # Serve calls check_health this often
    health_timeout_s: float = 10.0
    stats_period_s: float = 0.5  # routing stats (free KV, streams, load, draining, metrics) this often
    max_streams: int = 256  # Serve's max_ongoing_requests: sessions plus their messages, per replica


LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray's own switch that keeps every node address on loopback (its default on macOS and Windows): Ray
otherwise advertises the host's first routable address even for a one-machine instance."""


def group_replicas(gpus: int, parallel: int, devices: str | None = None) -> tuple[int, float]:
    """(replicas, GPUs each) for `--gpus G --parallel K`: G/K replicas of K GPUs, each one group of K ranks
    (0 replicas for --gpus 0: attach). ValueError, with the values that work, when K does not divide G."""
    if devices:
        raise ValueError(f"--devices {devices} with --cluster: Ray gives each replica its GPUs (num_gpus="
                         f"{parallel}); drop --devices")
    if parallel < 1 or gpus < 0:
        raise ValueError(f"--parallel takes 1 or more and --gpus 0 or more, got {parallel} and {gpus}")
    if gpus % parallel:
        fits = ", ".join(str(parallel * n) for n in range(1, 4))
        raise ValueError(f"--gpus {gpus} does not split into groups of --parallel {parallel}: each replica holds "
                         f"{parallel} GPUs, so --gpus must be a multiple of {parallel} ({fits}, ...)")
    return gpus // parallel, float(parallel)


def ray_defaults(loopback: bool = False) -> None:
    """Ray's environment defaults for streamsvc, set before ray is imported: no usage stats; with
    `loopback`, every Ray address on 127.0.0.1 (a one-machine instance, the tests)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if loopback:
        for k, v in LOOPBACK_ENV.items():
            os.environ.setdefault(k, v)


def connect(address: str, local_gpus: int | None = None, num_cpus: int | None = None) -> str:
    """Join a Ray cluster: 'local' starts a new one-machine instance on 127.0.0.1 with `local_gpus` GPUs
    (fake ones where the machine has fewer: for trying the cluster on a CPU); 'auto' joins the one `ray
    start` made on this machine; anything else is the head's address (HOST:PORT). Returns what was
    joined, in words."""
    # a head on a loopback address is a one-machine cluster: the driver must stay on loopback too (Ray would
    # otherwise look for it at the host's routable address)
    ray_defaults(loopback=address == "local" or address.rsplit(":", 1)[0] in ("127.0.0.1", "localhost"))
    parallel_env()  # a local instance's raylet and workers inherit it (the replicas also set it: `deploy`)
    import ray

    if address == "local":
        ray.init(address="local", num_gpus=local_gpus, num_cpus=num_cpus, include_dashboard=False,
                 _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING)
        return f"a new local Ray instance on 127.0.0.1 ({local_gpus if local_gpus is not None else 'all'} GPUs)"
    ray.init(address=address, logging_level=logging.WARNING)
    return "the Ray cluster running on this machine" if address == "auto" else f"the Ray cluster at {address}"


def actor_options(config: DeployConfig) -> dict:
    """A replica's Ray actor options: its GPUs and CPUs, and for a group's replica (--parallel K, K GPUs) the
    environment that keeps NVLink multicast off in its process and its ranks, on any cluster (a local instance's
    workers inherit it from `connect` too)."""
    options = {"num_gpus": config.num_gpus, "num_cpus": config.num_cpus}
    if config.num_gpus > 1:
        options["runtime_env"] = {"env_vars": dict(PARALLEL_ENV)}
    return options


def deploy(replica: ReplicaConfig, config: DeployConfig = DeployConfig()):
    """Run the engine deployment (Serve without its HTTP proxy); returns its handle once every replica is up."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from streamsvc.cluster.router import EngineRouter

    serve.start(proxy_location="Disabled")
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT, num_replicas=config.replicas, ray_actor_options=actor_options(config),
        max_ongoing_requests=config.max_streams, max_queued_requests=-1,
        graceful_shutdown_timeout_s=config.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=config.health_period_s, health_check_timeout_s=config.health_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=EngineRouter, request_routing_stats_period_s=config.stats_period_s,
            request_routing_stats_timeout_s=max(2.0, 4 * config.stats_period_s)),
    )
    return serve.run(deployment.bind(replica), name=APP, route_prefix=None)


def replica_config(engine, front: ServerConfig, **kw) -> ReplicaConfig:
    """What the replicas run for the gateway `front`: its WebRTC settings and per-stream rates; tokens,
    origins and per-client limits stay at the gateway, which checks them before placing a stream."""
    access = replace(front.access, tokens={}, allowed_origins=(), max_streams_per_client=None)
    return ReplicaConfig(engine=engine, server=ServerConfig(port=0, webrtc=front.webrtc, access=access), **kw)


def attach():
    """The handle of the engine deployment another gateway started."""
    from ray import serve

    return serve.get_deployment_handle(DEPLOYMENT, app_name=APP)


def serve_cluster(address: str, gpus: int, replica: ReplicaConfig, front: ServerConfig,
                  deploy_config: DeployConfig) -> int:
    """`streamsvc serve --cluster`: join (or start) Ray, run `gpus` engine replicas (0: attach to those
    running), serve the gateway (`front`) until SIGINT/SIGTERM. The replicas stay deployed when the
    gateway stops (`serve shutdown` or `ray stop` ends them), so a new gateway can attach."""
    from streamsvc.cluster.gateway import Gateway

    joined = connect(address, local_gpus=gpus)
    if gpus > 0:
        log.info("joined %s; starting %d engine replicas (%g GPUs each)", joined, deploy_config.replicas,
                 deploy_config.num_gpus)
        handle = deploy(replica, deploy_config)
    else:
        log.info("joined %s; attaching to the running engine replicas", joined)
        handle = attach()
    try:
        asyncio.run(Gateway(handle, front).serve_forever())
    except KeyboardInterrupt:
        pass
    return 0
