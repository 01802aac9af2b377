"""The engine on the tiny preset (CPU): plans launched, chunks encoded by the output stage and
delivered in order, prompts applied from the next chunk, costs measured, streams closed cleanly."""

import threading
import time

import pytest
import torch

from streamsvc.encode import StreamDecoder
from streamsvc.engine import Engine, EngineConfig, EngineError
from streamsvc.scheduler import SchedulerConfig, WorkKind


class Collector:
    def __init__(self):
        self.lock = threading.Lock()
        self.chunks: dict[str, list] = {}
        self.errors: list[tuple[str, str, str]] = []

    def on_chunk(self, out):
        with self.lock:
            self.chunks.setdefault(out.stream_id, []).append(out)

    def on_error(self, stream_id, message, code):
        with self.lock:
            self.errors.append((stream_id, message, code))

    def wait(self, predicate, timeout=20.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate(self):
                    return
            time.sleep(0.02)
        raise AssertionError(f"timed out; chunks {({k: len(v) for k, v in self.chunks.items()})}, errors {self.errors}")


@pytest.fixture
def engine():
    got = Collector()
    eng = Engine(EngineConfig(preset="tiny", device="cpu", scheduler=SchedulerConfig(buffer_cap_s=2.0, max_batch=4), warmup_chunks=5),
                 got.on_chunk, got.on_error)
    eng.start().result(timeout=60)
    yield eng, got
    eng.stop()


def test_streams_get_their_chunks_in_order_and_prompts_take_effect(engine):
    eng, got = engine
    guess = eng.sched.config.initial_forward_s
    assert all(0 < eng.sched.costs.estimate(kind) != guess for kind in WorkKind)  # measured at warm-up
    batch = eng.sched.config.max_batch
    assert batch > 1  # a full batch measured too: admission counts its gain before serving has run one
    for kind in (WorkKind.DENOISE, WorkKind.COMMIT):
        assert 0 < eng.sched.costs.estimate(kind, batch) != batch * eng.sched.costs.estimate(kind, 1)
    for sid in ("a", "b"):
        assert eng.open_stream(sid, f"prompt {sid}", seed=1, fps=16).result(timeout=10).accepted
    got.wait(lambda g: all(len(g.chunks.get(s, [])) >= 2 for s in ("a", "b")))
    version = eng.set_prompt("a", "a new prompt").result(timeout=10)
    assert version == 1
    got.wait(lambda g: any(c.header.prompt_version == 1 for c in g.chunks["a"]))
    assert not got.errors
    for sid in ("a", "b"):
        chunks = got.chunks[sid]
        assert [c.header.index for c in chunks] == list(range(len(chunks)))
        assert [c.header.pts for c in chunks[1:]] == [c.header.pts + c.header.frames for c in chunks[:-1]]
        versions = [c.header.prompt_version for c in chunks]
        assert versions == sorted(versions)  # a prompt, once applied, stays
        dec = StreamDecoder()
        frames = [f for c in chunks for au in c.access_units for f in dec.decode(au)]
        assert len(frames) == sum(c.header.frames for c in chunks) and frames[0].shape == (128, 128, 3)
        assert all(c.latency_s > 0 for c in chunks)
    assert eng.forwards["denoise"] >= 4 * eng.forwards["commit"] > 0 and eng.forwards["recache"] >= 1
    assert eng.gpu_seconds["denoise"] > 0 and eng.chunks_encoded >= len(got.chunks["a"]) + len(got.chunks["b"])


def test_close_frees_the_stream_and_unknown_streams_are_errors(engine):
    eng, got = engine
    assert eng.open_stream("a", "x", seed=0, fps=16).result(timeout=10).accepted
    got.wait(lambda g: len(g.chunks.get("a", [])) >= 1)
    used = eng.kv_used_bytes
    assert used > 0
    assert eng.close_stream("a").result(timeout=10) is True
    assert eng.kv_used_bytes == 0 and eng.gen.workspace.owner is None
    assert eng.close_stream("a").result(timeout=10) is False
    with pytest.raises(EngineError, match="not open"):
        eng.set_prompt("a", "y").result(timeout=10)
    n = len(got.chunks["a"])
    time.sleep(0.3)
    assert len(got.chunks["a"]) <= n + 1  # at most the chunk that was in the output stage
    assert not got.errors


def test_the_stream_the_scheduler_names_overloaded_is_ended_with_that_code_and_the_others_go_on(engine):
    eng, got = engine
    for sid in ("a", "b"):
        assert eng.open_stream(sid, f"prompt {sid}", seed=0, fps=16).result(timeout=10).accepted
    got.wait(lambda g: all(len(g.chunks.get(s, [])) >= 1 for s in ("a", "b")))
    named = iter(["b"])
    real = eng.sched.overloaded
    eng.sched.overloaded = lambda now: next(named, None) or real(now)  # degradation ran out: the scheduler names b
    got.wait(lambda g: g.errors)
    assert got.errors == [("b", got.errors[0][1], "overloaded")] and "overloaded" in got.errors[0][1]
    assert "b" not in eng.sched and eng.kv_used_bytes == eng.pool.used_bytes
    with pytest.raises(EngineError, match="not open"):
        eng.set_prompt("b", "y").result(timeout=10)
    n = len(got.chunks["a"])
    got.wait(lambda g: len(g.chunks["a"]) >= n + 2)  # a keeps playing


def test_keep_freed_memory_serves_large_cpu_tensors_from_the_heap():
    """After keep_freed_memory a 4 MB tensor is not a fresh mapping of its own (glibc's mallinfo2 counts them)."""
    import ctypes

    from streamsvc.engine import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        pytest.skip("not glibc (>= 2.33)")
    mallinfo2.restype = MallInfo2
    assert keep_freed_memory()
    before = mallinfo2().hblks
    blocks = [torch.empty(1 << 20) for _ in range(4)]  # 4 MB each, above malloc's default mmap threshold
    assert mallinfo2().hblks == before  # from the heap, not four new mappings
    del blocks
