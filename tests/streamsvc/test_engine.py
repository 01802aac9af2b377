"""The engine on the tiny preset (CPU): plans launched, chunks encoded by the output stage and
delivered in order, prompts applied from the next chunk, costs measured, streams closed cleanly."""

import threading
import time

import pytest
import torch

from models.work import WorkKind
from streamsvc.engine.config import EngineConfig
from streamsvc.engine.encode import StreamDecoder
from streamsvc.engine.engine import Engine
from streamsvc.engine.errors import EngineError
from streamsvc.scheduling import SchedulerConfig


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
    eng = Engine(EngineConfig(preset="tiny", device="cpu", scheduler=SchedulerConfig(buffer_cap_s=2.0, max_batch=4),
                              warmup_chunks=5),
                 got.on_chunk, got.on_error)
    eng.start().result(timeout=60)
    yield eng, got
    eng.stop()


def test_streams_get_their_chunks_in_order_and_prompts_take_effect(engine):
    eng, got = engine
    guess = eng.sched.config.initial_forward_s
    assert all(0 < eng.sched.costs.estimate(kind) != guess for kind in WorkKind)  # measured at warm-up
    batch = eng.sched.config.max_batch
    assert batch > 1  # a full batch and half of one measured too: admission counts their gain before serving ran one
    for kind in (WorkKind.DENOISE, WorkKind.COMMIT):
        for size in (batch, batch // 2):
            assert size in eng.sched.costs.sizes(kind)
            assert 0 < eng.sched.costs.estimate(kind, size) != size * eng.sched.costs.estimate(kind, 1)
    for sid in ("a", "b"):
        opened = eng.open_stream(sid, f"prompt {sid}", seed=1, fps=16).result(timeout=10)
        # admitted, and described for its viewers' `ready` from the engine thread (the event loop reads no model)
        assert opened.accepted and opened.stream.shape is eng.shape and opened.stream.fps == 16
        assert (eng.shape.width, eng.shape.steps) == (eng.gen.model_cfg.width, len(eng.gen.sigmas))
    got.wait(lambda g: all(len(g.chunks.get(s, [])) >= 2 for s in ("a", "b")))
    version = eng.set_prompt("a", "a new prompt").result(timeout=10).version
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
    assert eng.stats().forwards["denoise"] >= 4 * eng.stats().forwards["commit"] > 0
    assert eng.stats().forwards["recache"] >= 1
    assert eng.stats().gpu_seconds["denoise"] > 0
    assert eng.stats().chunks_encoded >= len(got.chunks["a"]) + len(got.chunks["b"])


def test_close_frees_the_stream_and_unknown_streams_are_errors(engine):
    eng, got = engine
    assert eng.open_stream("a", "x", seed=0, fps=16).result(timeout=10).accepted
    got.wait(lambda g: len(g.chunks.get("a", [])) >= 1)
    used = eng.stats().kv_used_bytes
    assert used > 0
    assert eng.close_stream("a").result(timeout=10) is True
    assert eng.stats().kv_used_bytes == 0 and eng.gen.workspace.owner is None
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
    assert "b" not in eng.sched and eng.stats().kv_used_bytes == eng.pool.used_bytes
    with pytest.raises(EngineError, match="not open"):
        eng.set_prompt("b", "y").result(timeout=10)
    n = len(got.chunks["a"])
    got.wait(lambda g: len(g.chunks["a"]) >= n + 2)  # a keeps playing


def test_keep_freed_memory_serves_large_cpu_tensors_from_the_heap():
    """After keep_freed_memory a 4 MB tensor is not a fresh mapping of its own (glibc's mallinfo2 counts them)."""
    import ctypes

    from streamsvc.engine.warmup import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

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


# ----- pause and resume: a paused stream's state parked in host memory -----------------------------


def _engine(**cfg):
    got = Collector()
    clock_offset = [0.0]
    defaults = dict(preset="tiny", device="cpu", degrade=False, warmup_chunks=5,
                    scheduler=SchedulerConfig(buffer_cap_s=2.0, max_batch=1))
    eng = Engine(EngineConfig(**{**defaults, **cfg}), got.on_chunk, got.on_error,
                 clock=lambda: time.monotonic() + clock_offset[0])
    eng.start().result(timeout=60)
    return eng, got, clock_offset


def _record_commits(eng):
    """Every committed chunk's latents and frames, by stream (wrapping the generator's commit)."""
    made: dict[str, list] = {}
    commit = eng.gen.commit

    def recorded(states):
        chunks = commit(states)
        for s, c in zip(states, chunks):
            made.setdefault(s.stream_id, []).append((c.index, c.prompt_version, c.latents.clone(), c.frames.clone()))
        return chunks

    eng.gen.commit = recorded
    return made


@pytest.mark.parametrize("chunk_latent_frames", [3, 1])
def test_a_paused_stream_parks_in_host_memory_and_resumes_exactly_where_it_was(chunk_latent_frames):
    from models import GeneratorConfig

    eng, got, _ = _engine(generator=GeneratorConfig(frames_per_chunk=chunk_latent_frames))
    made = _record_commits(eng)
    try:
        prompts = ["a cat", "a red boat", "a blue train"]
        for sid in ("a", "b"):
            assert eng.open_stream(sid, prompts[0], seed=5, fps=16).result(timeout=10).accepted
        got.wait(lambda g: len(g.chunks.get("a", [])) >= 2)
        assert eng.set_prompt("a", prompts[1]).result(timeout=10).version == 1
        used = eng.stats().kv_used_bytes
        reservation = eng.gen.cache_spec().stream_bytes() + eng.decoder_bytes
        paused = eng.pause("a").result(timeout=20)
        # the stream's device memory is back in the pool, its state in host memory
        assert paused.stream_id == "a" and paused.device_bytes == reservation and paused.seconds >= 0
        assert paused.nbytes > eng.gen.cache_spec().stream_bytes()
        assert eng.stats().kv_used_bytes == eng.pool.used_bytes == used - reservation
        assert (eng.stats().parked_streams, eng.stats().parked_bytes, eng.stats().parks,
                eng.stats().restores) == (1, paused.nbytes, 1, 0)
        assert eng.sched.is_parked("a") and eng.stats().park_seconds == eng.stats().last_park_seconds == paused.seconds
        assert eng.stats().last_restore_seconds is None
        with pytest.raises(EngineError, match="'a' is already paused"):
            eng.pause("a").result(timeout=10)
        n = len(made["a"])
        time.sleep(0.5)
        assert len(made["a"]) == n  # no chunk while parked (b goes on)
        assert eng.set_prompt("a", prompts[2]).result(timeout=10).version == 2  # steered while parked
        resumed = eng.resume("a").result(timeout=20)
        assert (resumed.nbytes, resumed.device_bytes) == (paused.nbytes, reservation)
        assert eng.stats().kv_used_bytes == used
        assert (eng.stats().parked_streams, eng.stats().parked_bytes, eng.stats().restores) == (0, 0, 1)
        assert eng.stats().restore_seconds == eng.stats().last_restore_seconds == resumed.seconds
        with pytest.raises(EngineError, match="'a' is not paused"):
            eng.resume("a").result(timeout=10)
        got.wait(lambda g: len(g.chunks.get("a", [])) >= n + 3)
        assert not got.errors
    finally:
        eng.stop()
    chunks = made["a"]
    assert [c[0] for c in chunks] == list(range(len(chunks)))
    assert chunks[n][1] == 2  # the first chunk after resume runs under the prompt set while parked
    # the same stream uninterrupted: a fresh stream of the engine's generator, each prompt from the chunk its
    # version first came with
    first = {}
    for index, version, _, _ in chunks:
        first.setdefault(version, index)
    prompt_at = {index: prompts[version] for version, index in first.items() if version}
    gen = eng.gen
    gen.commit = type(gen).commit.__get__(gen)
    it = gen.stream(gen.open_stream("ref", prompts[0], seed=5), prompt_at)
    for index, _, latents, frames in chunks:
        ref = next(it)
        assert torch.equal(ref.latents, latents) and torch.equal(ref.frames, frames), f"chunk {index}"


def test_pause_beyond_the_park_budget_is_refused_and_the_stream_goes_on():
    eng, got, _ = _engine(park_budget_bytes=1000)  # a tiny stream parks about 0.5 MB
    try:
        assert eng.open_stream("a", "x", seed=0, fps=16).result(timeout=10).accepted
        got.wait(lambda g: len(g.chunks.get("a", [])) >= 1)
        # in the units the sizes call for (it said "needs 0.00 GiB ... 0.00 GiB free of 0.00 GiB": issue 33)
        with pytest.raises(EngineError, match=r"cannot pause stream 'a': parking needs \d+(\.\d+)? KiB of host "
                                              r"memory but the park budget has 1000 bytes free of 1000 bytes "
                                              r"\(0 streams parked\)"):
            eng.pause("a").result(timeout=10)
        n = len(got.chunks["a"])
        got.wait(lambda g: len(g.chunks["a"]) >= n + 2)
        assert eng.stats().parked_streams == 0 and eng.park_budget.used_bytes == 0
    finally:
        eng.stop()


def test_the_park_warm_up_parks_a_throwaway_stream_and_leaves_nothing_behind():
    """Parking.warm_up (run at start on a GPU, so that the first pause does not pin host memory on the engine
    thread), forced here on the CPU: it parks one stream's worth and gives back its pool memory and park budget;
    a park budget too small for a stream makes it do nothing."""
    for budget, parks in ((None, True), (1000, False)):
        eng, got, _ = _engine(**({} if budget is None else {"park_budget_bytes": budget}))
        try:
            nbytes = eng._commands.submit(eng.parking.warm_up, False).result(timeout=30)
            assert (nbytes > 0) == parks
            assert eng.pool.used_bytes == 0 and eng.park_budget.used_bytes == 0 and "park-warmup" not in eng.sched
            assert eng.parking.table_sizes() == {"parking.streams": 0, "parking.budget_streams": 0}
            assert eng.open_stream("a", "x", seed=0, fps=16).result(timeout=10).accepted
            got.wait(lambda g: len(g.chunks.get("a", [])) >= 2)
        finally:
            eng.stop()


def test_a_park_larger_than_its_reservation_is_counted_whole_and_refuses_the_next_pause():
    # pause() reserves the stream's size at that moment; its chunk is committed before the copies, and a decoder
    # whose state that commit creates (a first chunk) or grows parks more than was reserved
    eng, got, _ = _engine(park_budget_bytes=1000)
    try:
        for sid in ("a", "b"):
            assert eng.open_stream(sid, "x", seed=0, fps=16).result(timeout=10).accepted
        got.wait(lambda g: len(g.chunks.get("a", [])) >= 1 and len(g.chunks.get("b", [])) >= 1)
        eng.gen.park_bytes = lambda state: 1  # what pause() reserves: far less than what the park copies
        paused = eng.pause("a").result(timeout=20)
        assert paused.nbytes > 1000
        # the host memory it really holds
        assert eng.stats().parked_bytes == eng.park_budget.used_bytes == paused.nbytes
        assert eng.park_budget.free_bytes == 1000 - paused.nbytes < 0
        with pytest.raises(EngineError, match="cannot pause stream 'b': parking needs"):
            eng.pause("b").result(timeout=10)
        assert eng.close_stream("a").result(timeout=10) and eng.park_budget.used_bytes == eng.stats().parked_bytes == 0
    finally:
        eng.stop()


def test_a_stream_parked_past_the_timeout_is_ended_and_its_memory_freed():
    eng, got, offset = _engine(park_timeout_s=60.0)
    try:
        assert eng.open_stream("a", "x", seed=0, fps=16).result(timeout=10).accepted
        got.wait(lambda g: len(g.chunks.get("a", [])) >= 1)
        eng.pause("a").result(timeout=20)
        time.sleep(0.3)
        assert not got.errors and eng.stats().parked_streams == 1
        offset[0] += 61.0  # a minute later
        got.wait(lambda g: g.errors)
        assert got.errors == [("a", got.errors[0][1], "park_expired")] and "--park-timeout" in got.errors[0][1]
        assert (eng.stats().parked_streams, eng.stats().parked_bytes, eng.park_budget.used_bytes,
                eng.stats().kv_used_bytes) == (0, 0, 0, 0)
        assert "a" not in eng.sched
        with pytest.raises(EngineError, match="not open"):
            eng.resume("a").result(timeout=10)
    finally:
        eng.stop()


def test_resume_is_refused_without_kv_room_and_the_stream_stays_parked():
    from tests.conftest import tiny_generator

    gen = tiny_generator()
    room = gen.cache_spec().stream_bytes() + gen.decoder_state_bytes()
    eng, got, _ = _engine(kv_budget_bytes=room + 100)  # room for one stream
    try:
        assert eng.open_stream("a", "x", seed=0, fps=16).result(timeout=10).accepted
        assert not eng.open_stream("b", "y", seed=0, fps=16).result(timeout=10).accepted
        got.wait(lambda g: len(g.chunks.get("a", [])) >= 1)
        eng.pause("a").result(timeout=20)
        assert eng.open_stream("b", "y", seed=0, fps=16).result(timeout=10).accepted  # a's room, freed
        with pytest.raises(EngineError, match=r"cannot resume stream 'a' now: kv cache: KV cache needs .* but the "
                                              r"pool has 100 bytes free"):  # (not "0.0 MiB": issue 33)
            eng.resume("a").result(timeout=10)
        assert eng.stats().parked_streams == 1 and eng.sched.is_parked("a")
        with pytest.raises(EngineError, match="'zz' is not open"):
            eng.resume("zz").result(timeout=10)
        assert eng.close_stream("b").result(timeout=10)
        eng.resume("a").result(timeout=20)
        n = len(got.chunks["a"])
        got.wait(lambda g: len(g.chunks["a"]) >= n + 2)
        assert eng.close_stream("a").result(timeout=10) and eng.stats().kv_used_bytes == 0
    finally:
        eng.stop()


def test_closing_a_paused_stream_frees_its_host_memory():
    eng, got, _ = _engine()
    try:
        assert eng.open_stream("a", "x", seed=0, fps=16).result(timeout=10).accepted
        got.wait(lambda g: len(g.chunks.get("a", [])) >= 1)
        eng.pause("a").result(timeout=20)
        assert eng.stats().parked_bytes > 0
        assert eng.close_stream("a").result(timeout=10) is True
        assert (eng.stats().parked_streams, eng.stats().parked_bytes, eng.stats().kv_used_bytes) == (0, 0, 0)
        assert "a" not in eng.sched
    finally:
        eng.stop()


# ---------------------------------------------------------------- issue 33: costs no stream-less client can raise


def test_the_warm_up_seeds_the_send_stage_with_what_sending_its_chunks_cost(engine):
    eng, _ = engine
    from streamsvc.scheduling import Scheduler, Stage

    guess = Scheduler().stage_costs.estimate(Stage.SEND)  # before: the first sample served, whatever it was charged
    assert 0 < eng.sched.stage_costs.estimate(Stage.SEND) != guess


def test_send_cost_s_is_the_loop_threads_cpu_per_chunk_written():
    from streamsvc.engine.warmup import send_cost_s

    ticks = iter([1.0, 1.5])  # the loop thread's CPU clock, read before and after the 4 chunks
    assert send_cost_s([b"x" * 6000, b"y" * 70000, b"z", b"w" * 200], cpu_clock=lambda: next(ticks)) == 0.125
    assert send_cost_s([]) > 0


def test_on_cpu_a_forwards_cost_sample_leaves_out_the_loops_work_for_clients_without_a_stream():
    # issue 33: a forward's wall time on CPU grew with the event loop's work for a flooding client (it holds the
    # GIL and a core), and admission refused every stream on it ("compute: ... 493 ms per chunk").
    flooding, metered = [True], [0.0]

    def streamless() -> tuple[float, int]:  # the server's meter: while flooding, a second of stream-less CPU a reading
        metered[0] += 1.0 if flooding[0] else 0.0
        return metered[0], 0

    got = Collector()
    eng = Engine(EngineConfig(preset="tiny", device="cpu", scheduler=SchedulerConfig(cost_min_samples=1),
                              warmup_chunks=5), got.on_chunk, got.on_error, streamless=streamless)
    eng.start().result(timeout=60)
    try:
        seeded = {kind: eng.sched.costs.estimate(kind) for kind in WorkKind}
        assert eng.open_stream("a", "x", seed=0, fps=16).result(timeout=10).accepted
        got.wait(lambda g: len(g.chunks.get("a", [])) >= 2)
        assert eng.stats().forwards[WorkKind.DENOISE.value] > 0
        # every sample was mostly the flood's (a second against a forward of milliseconds): dropped, not believed
        assert {kind: eng.sched.costs.estimate(kind) for kind in WorkKind} == seeded
        flooding[0] = False
        n = len(got.chunks["a"])
        got.wait(lambda g: len(g.chunks["a"]) >= n + 2)
        assert eng.sched.costs.estimate(WorkKind.DENOISE) != seeded[WorkKind.DENOISE]  # measured again
    finally:
        eng.stop()


def test_chunks_of_one_latent_frame_play_and_steer_and_the_lone_first_frame_goes_out_with_the_second():
    """--chunk-latent-frames 1: chunks of 4 frames after a first of 1 (the VAE's first latent frame is one frame),
    which the engine hands over with the second: alone, its viewer would play it and stall."""
    from models import GeneratorConfig

    got, arrived = Collector(), []
    on_chunk = got.on_chunk

    def timed(out):
        arrived.append((out.header.index, time.monotonic()))
        on_chunk(out)

    eng = Engine(EngineConfig(preset="tiny", device="cpu", generator=GeneratorConfig(frames_per_chunk=1),
                              scheduler=SchedulerConfig(buffer_cap_s=1.0, max_batch=4), warmup_chunks=5),
                 timed, got.on_error)
    eng.start().result(timeout=60)
    try:
        assert (eng.shape.first_chunk_frames, eng.shape.chunk_frames) == (1, 4)
        assert eng.open_stream("a", "a red ball moving right", seed=1, fps=16).result(timeout=10).accepted
        got.wait(lambda g: len(g.chunks.get("a", [])) >= 6)
        assert eng.set_prompt("a", "a blue square moving left").result(timeout=10).version == 1
        got.wait(lambda g: any(c.header.prompt_version == 1 for c in g.chunks["a"]))
        chunks = got.chunks["a"]
        assert [c.header.frames for c in chunks[:4]] == [1, 4, 4, 4] and not got.errors
        assert [c.header.pts for c in chunks[1:]] == [c.header.pts + c.header.frames for c in chunks[:-1]]
        (i0, t0), (i1, t1), (i2, t2) = arrived[:3]
        assert (i0, i1, i2) == (0, 1, 2)
        assert t1 - t0 < 0.2 * (t2 - t1)  # handed over together; the third comes a chunk's work later
        assert eng.stats().forwards["recache"] >= 1
    finally:
        eng.stop()


def test_a_stream_from_an_image_gets_it_as_chunk_zero_and_a_bad_one_leaves_nothing_behind(engine):
    """open_stream(image=...): chunk 0 is the image's one frame (input "image", delivered with chunk 1), counted by
    the scheduler as the stream's first chunk; an image of the wrong size fails the open and frees what it took; an
    image with input, or on a model without an encoder, is refused with the reason."""
    import numpy as np

    from streamsvc.engine.images import StartImages

    eng, got = engine
    image = np.full((eng.shape.height, eng.shape.width, 3), (200, 40, 90), np.uint8)
    opened = eng.open_stream("a", "a ball", seed=0, fps=16, image=image).result(timeout=10)
    assert opened.accepted and opened.stream.image
    assert eng._get("a").state.input_kind == "image"  # under the model's input adapter, where it has one for images
    got.wait(lambda g: len(g.chunks.get("a", [])) >= 3)
    heads = [c.header for c in got.chunks["a"][:3]]
    assert [(h.index, h.pts, h.frames, h.input) for h in heads] == [(0, 0, 1, "image"), (1, 1, 12, "none"),
                                                                     (2, 13, 12, "none")]
    assert heads[0].keyframe and not heads[1].keyframe and heads[0].steps == eng.shape.steps
    frame = StreamDecoder().decode(got.chunks["a"][0].access_units[0])[0]
    want, other = [eng.gen.start_from_image(eng.gen.open_stream("ref", "a ball", seed=0),
                                            torch.from_numpy(img)).frames[0].numpy().astype(int)
                   for img in (image, 255 - image)]
    err = [np.abs(frame.astype(int) - x).mean() for x in (want, other)]
    assert err[0] < 0.5 * err[1], err  # the image's frame as the model decodes it, through x264 (random weights)
    assert eng.sched.stream_stats("a", eng.clock()).chunks_delivered >= 3

    assert eng.close_stream("a").result(timeout=10)  # (a stream alone: admission's closed loop cannot refuse it)
    with pytest.raises(ValueError, match=r"\[N, 128, 128, 3\] uint8"):
        eng.open_stream("b", "a ball", seed=0, fps=16, image=image[:64]).result(timeout=10)
    assert "b" not in eng.sched and eng.stats().kv_used_bytes == 0
    refused = eng.open_stream("c", "a ball", seed=0, fps=16, image=image, input=object()).result(timeout=10)
    assert not refused.accepted and "not both" in refused.reason
    eng.images = StartImages(None)  # an engine whose model has no encoder
    refused = eng.open_stream("d", "a ball", seed=0, fps=16, image=image).result(timeout=10)
    assert not refused.accepted and "this model has no encoder" in refused.reason
    assert not got.errors
