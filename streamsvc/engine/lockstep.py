"""`streamsvc serve --parallel K`: the engine's generator on rank 0 of a group, the other ranks in lockstep.

Rank 0 (the server's process) runs the scheduler, the server and the output stage, as with one device. Its
engine's generator is a `LockstepGenerator`: each call that changes a stream or runs a forward (open, close,
prompt, steps, recache, denoise, commit, park, restore, and the warm-up's run) is first broadcast to the
group as a `Call` (the method, and its arguments with each stream named by its id), then made on rank 0's
`ShardedGenerator`. Ranks 1..K-1 run `serve_rank`: build the same sharded generator (the DiT only: rank 0
encodes prompts and decodes chunks), then replay each call on their own stream states (caches of their
heads, outside any pool: rank 0's pool admits for the group), so every forward's collectives meet. A
stream closed while paused is closed on the workers too: its parked copy goes (`worker_holdings` says
what each worker holds). Start-up waits for every worker's generator, and fails at once when one is gone
(streamsvc/engine/group.py). The group's cost is rank 0's timing of its forwards: admission treats
the group as one device.

The calls and the forwards' collectives time out after --parallel-timeout (gloo's broadcast waits for its
receivers, so a stopped rank blocks rank 0's next call). While no call goes out, rank 0 sends a ping at a
quarter of that, so idle workers keep waiting, and a rank that dies or hangs is noticed with no stream
playing. Then `LockstepGenerator.failure` says which rank and how, every later call raises `GroupError` at
once, and the engine ends the group's streams (worker_lost), answers /healthz with 503 and refuses every
start with the reason. A worker whose rank 0 stops answering exits after the same timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvcache import StreamCache
from models.parallel import build_base, build_worker_generator, check_degree, root_rank, shard_generator
from models.stream import ParkedStream, StreamState
from streamsvc.engine.group import Group, GroupConfig, GroupError, worker_ready

log = logging.getLogger("streamsvc.lockstep")

PING = "ping"  # a call that keeps idle workers waiting (no generator method)
HOLDINGS = "holdings"  # a call that asks each worker what it holds (`LockstepGenerator.worker_holdings`)


@dataclass(frozen=True)
class Call:
    """One generator call, as broadcast to the group's workers."""

    method: str  # the ChunkGenerator method
    args: tuple  # its arguments: a stream as ("state", id) or ("parked", id), a list of them as a list; a cache None
    kwargs: dict  # its keyword arguments, the same way


# the calls a worker replays; the other attributes (cfg, sigmas, cache_spec, ...) are rank 0's own
LOCKSTEP = ("open_stream", "close_stream", "set_prompt", "abandon_chunk", "set_steps", "encode_prompt", "recache",
            "denoise", "commit", "run", "park", "restore")


def _ref(arg):
    if isinstance(arg, StreamState):
        return ("state", arg.stream_id)
    if isinstance(arg, ParkedStream):
        return ("parked", arg.state.stream_id)
    if isinstance(arg, StreamCache):
        return None  # each rank's cache of its heads: a worker makes its own
    if isinstance(arg, (list, tuple)):
        return [_ref(a) for a in arg]
    return arg


class LockstepGenerator:
    """Rank 0's generator: broadcasts each call of LOCKSTEP to the group, then makes it (module doc)."""

    def __init__(self, inner, group: Group) -> None:
        self.inner, self.group = inner, group
        self.failure: str | None = None  # why the group cannot go on (None: it can)
        self._lock = threading.Lock()  # one call at a time on the group: the engine thread's or the pinger's
        self._sent_at = time.monotonic()
        self._closed = threading.Event()
        self._pinger = threading.Thread(target=self._ping, name="group-ping", daemon=True)
        self._pinger.start()

    def _send(self, call: Call | None) -> None:
        """Broadcast `call` to the workers (the lock held); a failure sets `failure` and raises GroupError."""
        try:
            dist.broadcast_object_list([call], src=root_rank(self.group.group), group=self.group.group)
        except RuntimeError as e:  # a collective failed or timed out (DistBackendError is a RuntimeError)
            self._failed(e)
        self._sent_at = time.monotonic()

    def _failed(self, e: BaseException) -> None:
        if self.failure is None:
            self.failure = self.group.describe_failure(e)
            log.error("%s", self.failure)
        raise GroupError(self.failure) from e

    def _ping(self) -> None:
        every = self.group.cfg.timeout_s / 4
        while not self._closed.wait(every / 4):
            if self.failure is not None:
                return
            if time.monotonic() - self._sent_at < every:
                continue
            with self._lock:
                if self.failure is None and not self._closed.is_set():
                    try:
                        self._send(Call(PING, (), {}))
                    except GroupError:
                        return

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name not in LOCKSTEP:
            return attr

        def call(*args, **kwargs):
            if self.failure is not None:
                if name == "close_stream":  # no collective: rank 0 forgets the stream
                    return attr(*args, **kwargs)
                raise GroupError(self.failure)
            with self._lock:
                self._send(Call(name, tuple(_ref(a) for a in args), {k: _ref(v) for k, v in kwargs.items()}))
                try:
                    return attr(*args, **kwargs)
                except RuntimeError as e:
                    if isinstance(e, GroupError) or not _collective_error(e):
                        raise
                    self._failed(e)

        return call

    def worker_holdings(self) -> list[dict]:
        """What ranks 1..K-1 hold, one dict each: streams (open, on the device), parked (streams parked in host
        memory) and parked_bytes (their host memory). Raises GroupError when the group has failed."""
        if self.failure is not None:
            raise GroupError(self.failure)
        with self._lock:
            self._send(Call(HOLDINGS, (), {}))
            out = [None] * self.group.cfg.size
            try:
                dist.gather_object(None, out, dst=root_rank(self.group.group), group=self.group.group)
            except RuntimeError as e:
                self._failed(e)
        return out[1:]

    def close(self) -> None:
        """The workers stop (a None call) and the group is left; after a failure, the workers are killed."""
        self._closed.set()
        with self._lock:
            if self.failure is None:
                try:
                    self._send(None)
                except GroupError:
                    pass
            self.group.close(kill=self.failure is not None)


def group_generator(preset: str, group_cfg: GroupConfig, cfg, kw: dict) -> LockstepGenerator:
    """Rank 0's generator for a group of `group_cfg.size`: checks k against the loaded model (ValueError naming
    the allowed values, before any rank starts), spawns ranks 1..K-1 (`serve_rank`) and joins them."""
    if torch.device(kw["device"]).type == "cuda":
        torch.cuda.set_device(torch.device(kw["device"]))  # where NCCL's broadcast of calls stages its bytes
    base = build_base(preset, cfg=cfg, **kw)
    check_degree(base.model_cfg, group_cfg.size)
    group = Group(group_cfg, serve_rank, (preset, cfg, kw))
    try:
        gen = shard_generator(base, cfg, group.group, root_only=True)
        group.wait_ready()  # every rank has built its generator; a rank gone meanwhile is a GroupError at once
    except Exception:
        group.close(kill=True)
        raise
    log.info("a group of %d ranks (%s), collectives time out after %g s: rank 0 serves, the others replay its calls",
             group_cfg.size, ", ".join(group_cfg.devices), group_cfg.timeout_s)
    return LockstepGenerator(gen, group)


def serve_rank(rank: int, group: dist.ProcessGroup, device: str, preset: str, cfg, kw: dict) -> None:
    """Rank 1..K-1 of a serving group: replay rank 0's calls until it says stop (None)."""
    if torch.device(device).type == "cpu":
        torch.set_num_threads(1)
    gen = build_worker_generator(preset, group=group, cfg=cfg, **{**kw, "device": torch.device(device)})
    worker_ready(group)  # rank 0's calls start once every rank is built
    states: dict[str, StreamState] = {}
    parked: dict[str, ParkedStream] = {}

    def resolve(arg):
        if isinstance(arg, tuple) and len(arg) == 2 and arg[0] in ("state", "parked"):
            return (states if arg[0] == "state" else parked)[arg[1]]
        if isinstance(arg, list):
            return [resolve(a) for a in arg]
        return arg

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=root_rank(group), group=group)
        call: Call | None = box[0]
        if call is None:
            return
        if call.method == PING:
            continue
        if call.method == HOLDINGS:
            held = {"streams": len(states), "parked": len(parked), "parked_bytes": sum(p.nbytes for p in parked.values())}
            dist.gather_object(held, None, dst=root_rank(group), group=group)
            continue
        if call.method == "close_stream":  # open or parked (a stream closed while paused): forgotten either way
            sid = call.args[0][1]
            parked.pop(sid, None)
            if sid not in states:
                continue
        try:
            args, kwargs = [resolve(a) for a in call.args], {k: resolve(v) for k, v in call.kwargs.items()}
            if call.method == "restore":
                args[1] = StreamCache(gen.cache_spec(), gen.device)
            out = getattr(gen, call.method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - rank 0's call raised the same (the engine reported it there)
            if isinstance(e, RuntimeError) and _collective_error(e):
                raise
            log.warning("rank %d: %s(%s) raised %s: %s, as on rank 0", rank, call.method, call.args, type(e).__name__, e)
            continue
        if call.method in ("open_stream", "restore"):
            states[out.stream_id] = out
            parked.pop(out.stream_id, None)
        elif call.method == "park":
            parked[out.state.stream_id] = out
            states.pop(out.state.stream_id, None)
        elif call.method == "close_stream":
            states.pop(args[0].stream_id, None)


def _collective_error(e: RuntimeError) -> bool:
    """Whether a generator call's RuntimeError came from the group (gloo / NCCL), not from the call itself."""
    return isinstance(e, dist.DistBackendError) or "gloo" in str(e) or "NCCL" in str(e) or "Timed out" in str(e)
