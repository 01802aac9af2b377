"""benchmarks/soak.py: its figures on synthetic series (windows, drift, growth, latency from histogram buckets, frame
statistics, pixel scores on rendered frames), each slot's churn plan, and a short run against a local server."""

import json
import sys

import numpy as np
import pytest

from benchmarks import soak
from benchmarks import soak_figures as sf
from benchmarks.soak_churn import Act, ChurnConfig, sessions, slot_plan
from benchmarks.soak_streams import FrameSampler, Samples
from streamsvc.wire import protocol as P
from client.loadtest_prompts import viewer_prompt
from models.scenes import Scene, Timeline, vocabulary

# ---------------------------------------------------------------- windows, drift, growth


def test_an_hour_compares_minute_5_and_minutes_5_15_with_the_last_10():
    w = sf.windows(3600.0)
    assert (w.growth_from_s, w.early, w.late, w.scale) == (300.0, (300.0, 900.0), (3000.0, 3600.0), 1.0)
    longer = sf.windows(7200.0)  # an hour's points, not scaled up
    assert (longer.growth_from_s, longer.early, longer.late) == (300.0, (300.0, 900.0), (6600.0, 7200.0))


def test_a_shorter_run_scales_the_windows_to_its_length():
    w = sf.windows(1200.0)  # 20 minutes: a third of an hour
    assert w.scale == pytest.approx(1 / 3)
    assert w.growth_from_s == pytest.approx(100.0) and w.early == pytest.approx((100.0, 300.0))
    assert w.late == pytest.approx((1000.0, 1200.0))
    short = sf.windows(24.0, minute_s=6.0)  # 4 test minutes of 6 s
    assert short.scale == pytest.approx(4 / 60) and short.growth_from_s == pytest.approx(2.0)
    assert short.late == pytest.approx((20.0, 24.0))


def test_drift_is_the_last_15_percent_less_the_first():
    flat = [(t, 5.0) for t in range(100)]
    d = sf.drift(flat, 100.0)
    assert (d["first"], d["last"], d["delta"], d["relative"]) == (5.0, 5.0, 0.0, 0.0)
    ramp = [(float(t), t / 100) for t in range(100)]  # 0 .. 0.99 over a run of 100 s
    d = sf.drift(ramp, 100.0)
    assert d["first"] == pytest.approx(np.mean(np.arange(15) / 100))  # t in [0, 15)
    assert d["last"] == pytest.approx(np.mean(np.arange(85, 100) / 100))  # t in [85, 100]
    assert d["delta"] == pytest.approx(0.85) and d["samples"] == (15, 15)
    assert sf.drift([], 100.0)["delta"] is None
    assert sf.drift([(1.0, 0.0), (99.0, 1.0)], 100.0)["relative"] is None  # from 0: no relative change


def test_growth_counts_from_its_point_and_shows_the_range_after():
    rss = [(60.0, 100.0), (300.0, 200.0), (600.0, 210.0), (900.0, 205.0), (1200.0, 220.0)]
    g = sf.growth(rss, 300.0)
    assert g == {"from_s": 300.0, "start": 200.0, "end": 220.0, "change": 20.0, "relative": pytest.approx(0.1),
                 "min": 200.0, "max": 220.0}
    assert sf.growth(rss, 250.0)["from_s"] == 300.0  # the first sample from then on
    assert sf.growth(rss, 5000.0)["start"] == 220.0  # past the end: the last
    assert sf.growth([], 0.0) is None
    assert sf.growth([(0.0, 0.0), (1.0, 3.0)], 0.0)["relative"] is None


def test_window_mean_takes_the_samples_in_the_half_open_window():
    s = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0), (3.0, 10.0)]
    assert sf.window_mean(s, 1.0, 3.0) == 2.5 and sf.window_mean(s, 4.0, 5.0) is None


def test_the_mix_adjusted_drift_compares_each_prompt_with_itself():
    ball, triangle = ("red", "ball", "right"), ("red", "triangle", "right")
    # the first 15 s ask for balls (all right), the last for triangles (half right): no prompt got worse
    chunks = [(float(t), ball, 12, 12) for t in range(0, 15)] + [(float(t), triangle, 6, 12) for t in range(85, 100)]
    chunks += [(50.0, ball, 12, 12), (50.0, triangle, 6, 12)]
    raw = sf.drift([(t, r / n) for t, _, r, n in chunks], 100.0)
    assert raw["delta"] == pytest.approx(-0.5)  # the raw score reads the mix as drift
    same = sf.mix_adjusted_drift(chunks, 100.0)
    assert same["delta"] == pytest.approx(0.0) and same["samples"] == (180, 180)
    worse = chunks + [(90.0, ball, 0, 12)]  # a ball that came out wrong at the end: drift
    assert sf.mix_adjusted_drift(worse, 100.0)["delta"] < -0.05
    assert sf.mix_adjusted_drift([], 100.0)["delta"] is None


def test_the_mix_adjusted_drift_of_a_frame_statistic_is_relative_to_the_runs_mean():
    # sums over 12 frames: a dark prompt (mean 20) early, a bright one (mean 100) late, both at the middle too
    chunks = [(5.0, "a dark night", 240.0, 12), (95.0, "a sunny beach", 1200.0, 12),
              (50.0, "a dark night", 240.0, 12), (50.0, "a sunny beach", 1200.0, 12)]
    assert sf.mix_adjusted_drift(chunks, 100.0)["relative"] == pytest.approx(0.0)
    dimmer = chunks[:1] + [(95.0, "a sunny beach", 840.0, 12)] + chunks[2:]  # the beach at 70 at the end
    d = sf.mix_adjusted_drift(dimmer, 100.0)
    # the beach's run mean is 85: first 0 (the night against itself), last 70 - 85; the run's mean is 52.5
    assert d["delta"] == pytest.approx(-15.0) and d["relative"] == pytest.approx(-15.0 / 52.5)


# ---------------------------------------------------------------- latency from the histogram


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does():
    buckets = [(0.1, 0.0), (0.2, 50.0), (0.4, 90.0), (0.8, 100.0), (float("inf"), 100.0)]
    assert sf.histogram_quantile(buckets, 0.5) == pytest.approx(0.2)  # rank 50: the top of (0.1, 0.2]
    assert sf.histogram_quantile(buckets, 0.25) == pytest.approx(0.15)  # rank 25: halfway in (0.1, 0.2]
    assert sf.histogram_quantile(buckets, 0.95) == pytest.approx(0.6)  # rank 95: halfway in (0.4, 0.8]
    over = [(0.1, 0.0), (0.2, 1.0), (float("inf"), 10.0)]
    assert sf.histogram_quantile(over, 0.95) == 0.2  # in +Inf: the largest finite bound
    assert sf.histogram_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None
    assert sf.highest_bucket(buckets) == 0.8 and sf.highest_bucket([(0.1, 0.0)]) is None


def test_a_windows_quantile_is_read_off_the_buckets_change_between_scrapes():
    def scrape(n_fast, n_slow):  # cumulative: n_fast chunks in (0, 0.1], n_slow in (0.1, 0.5]
        return {0.1: n_fast, 0.5: n_fast + n_slow, float("inf"): n_fast + n_slow}

    scrapes = [(0.0, scrape(0, 0)), (60.0, scrape(100, 0)), (120.0, scrape(100, 100)), (180.0, scrape(200, 100))]
    assert sf.window_quantile(scrapes, 60.0, 120.0, 0.5) == pytest.approx(0.3)  # only slow ones: halfway in (0.1, 0.5]
    assert sf.window_quantile(scrapes, 0.0, 60.0, 0.5) == pytest.approx(0.05)
    assert sf.window_quantile(scrapes, 70.0, 100.0, 0.5) == pytest.approx(0.3)  # widened to the scrapes around it
    assert sf.window_quantile(scrapes[:1], 0.0, 60.0, 0.5) is None
    assert soak.buckets({"streamsvc_chunk_latency_seconds_bucket{le=0.1}": 3.0,
                         "streamsvc_chunk_latency_seconds_bucket{le=inf}": 4.0, "other": 1.0}) == {0.1: 3.0,
                                                                                                  float("inf"): 4.0}


def test_table_series_are_read_generically_by_their_labels():
    m = {"streamsvc_table_entries{table=sessions}": 3.0, "streamsvc_table_entries{kind=a,table=b}": 1.0,
         "streamsvc_streams{state=playing}": 2.0}
    assert soak.tables(m) == {"sessions": 3.0, "a,b": 1.0}
    assert soak.tables(None) == {}


# ---------------------------------------------------------------- frames


def test_frame_statistics_of_known_frames():
    grey = np.full((16, 16, 3), 100, np.uint8)
    st = sf.frame_stats(grey)
    assert st.brightness == pytest.approx(100.0, abs=0.01) and st.saturation == 0.0 and st.sharpness == 0.0
    red = np.zeros((16, 16, 3), np.uint8)
    red[..., 0] = 200
    assert sf.frame_stats(red).saturation == pytest.approx(1.0)
    assert sf.frame_stats(red).brightness == pytest.approx(0.299 * 200, abs=0.01)
    checker = (np.indices((16, 16)).sum(0) % 2 * 255).astype(np.uint8)[..., None].repeat(3, -1)
    blurred = np.full_like(checker, 128)
    assert sf.frame_stats(checker).sharpness > 1000 > sf.frame_stats(blurred).sharpness
    assert sf.frame_change(checker, checker) == 0.0
    assert sf.frame_change(grey, grey + 10) == pytest.approx(10.0, abs=0.01)


def rendered(colour: str, shape: str, motion: str, n: int = 12) -> list[np.ndarray]:
    timeline = Timeline(((0, Scene(colour, shape, motion=motion), "x"),), height=128, width=128)
    return list(timeline.render(list(range(n))).numpy())


def test_the_renderers_frames_match_their_own_triple_and_not_another():
    frames = rendered("red", "square", "right")
    right = sf.score_chunk(frames, ("red", "square", "right"))
    assert right == sf.ChunkScore(frames=12, colour=12, shape=12, motion=12, all=12)
    wrong = sf.score_chunk(frames, ("blue", "square", "left"))
    assert (wrong.colour, wrong.shape, wrong.motion, wrong.all) == (0, 12, 0, 0)


class Decoded:
    """A frame as the client's decoder gives it (an av.VideoFrame's to_ndarray)."""

    def __init__(self, rgb: np.ndarray) -> None:
        self.rgb = rgb

    def to_ndarray(self, format: str) -> np.ndarray:
        assert format == "rgb24"
        return self.rgb


def test_the_sampler_reads_one_chunk_in_k_and_scores_settled_chunks_against_their_prompt():
    samples, t = Samples(), [0.0]
    sampler = FrameSampler(samples, every=2, since=lambda: t[0], score=True, settle=2)
    sampler.versions = {0: ("red", "square", "right"), 1: ("blue", "ball", "left"), 2: None}
    red = [Decoded(f) for f in rendered("red", "square", "right")]

    def chunk(index: int, version: int) -> None:
        t[0] = float(index)
        sampler(P.Chunk.describe([b"x"] * 12, index=index, pts=12 * index, prompt_version=version, steps=4,
                                 keyframe=index == 0), red)

    for i in range(6):  # version 0: read chunks 0, 2, 4; scored 2 and 4 (0 is the switch's, 1 the next)
        chunk(i, 0)
    assert samples.chunks_read == 3 and len(samples.brightness) == 36 and len(samples.change) == 33
    assert [v for _, v in samples.all] == [1.0] * 24 and {t for t, _ in samples.all} == {2.0, 4.0}
    for i in range(6, 10):  # version 1 asks for a blue ball moving left: read 6 and 8, scored 8, all wrong
        chunk(i, 1)
    assert [v for t, v in samples.all if t == 8.0] == [0.0] * 12
    # by chunks since the switch, settled or not: 0 (chunks 0 and 6), 2 (2 and 8), 4 (4)
    assert samples.by_position == {0: [12, 24], 2: [12, 24], 4: [12, 12]}
    assert samples.by_switches == {0: [24, 24], 1: [0, 12]}  # settled chunks, by the prompts before theirs
    red_square, blue_ball = ("red", "square", "right"), ("blue", "ball", "left")
    assert [key for _, key, _, _ in samples.scored_with_history] == [(red_square, 0), (red_square, 0), (blue_ball, 1)]
    for i in range(10, 14):  # version 2 is no caption: read, not scored
        chunk(i, 2)
    assert samples.chunks_read == 7 and len(samples.all) == 36
    assert samples.by_prompt == {}  # no prompt texts given: no frame statistics by prompt


def test_a_sampler_with_a_reader_reads_off_the_callers_thread_and_records_the_same():
    """`--decode thread`: the sampled chunks' frames are converted and scored on the reader's worker, not on the loop
    that calls the tap; what it records is what reading them inline records."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    readers = set()

    class Traced(Decoded):
        def to_ndarray(self, format: str) -> np.ndarray:
            readers.add(threading.get_ident())
            return super().to_ndarray(format)

    frames = [Traced(f) for f in rendered("red", "square", "right")]
    got = []
    for reader in (None, ThreadPoolExecutor(1)):
        samples, t = Samples(), [0.0]
        sampler = FrameSampler(samples, every=2, since=lambda: t[0], score=True, settle=2, reader=reader)
        sampler.versions, sampler.prompts = {0: ("red", "square", "right")}, {0: "a red square moving right"}
        for i in range(8):
            t[0] = float(i)
            sampler(P.Chunk.describe([b"x"] * 12, index=i, pts=12 * i, prompt_version=0, steps=4, keyframe=i == 0), frames)
        if reader is not None:
            reader.shutdown(wait=True)
        samples.read_s = 0.0
        got.append(samples)
    assert got[0] == got[1] and got[0].chunks_read == 4 and got[0].all
    assert len(readers) == 2 and threading.get_ident() in readers  # inline on this thread, then on the worker


def test_the_sampler_keeps_settled_chunks_frame_statistics_by_their_prompts_text():
    samples, t = Samples(), [0.0]
    sampler = FrameSampler(samples, every=1, since=lambda: t[0], score=False, settle=2)
    sampler.prompts = {0: "a red square moving right"}
    red = [Decoded(f) for f in rendered("red", "square", "right")]
    for i in range(4):  # chunks 2 and 3 are settled
        t[0] = float(i)
        sampler(P.Chunk.describe([b"x"] * 12, index=i, pts=12 * i, prompt_version=0, steps=4, keyframe=i == 0), red)
    sharp = samples.by_prompt["sharpness"]
    assert [(t, p, n) for t, p, _, n in sharp] == [(2.0, "a red square moving right", 12), (3.0, "a red square moving right", 12)]
    per_frame = [v for t, v in samples.sharpness if t == 2.0]
    assert sharp[0][2] == pytest.approx(sum(per_frame))
    assert [n for *_, n in samples.by_prompt["change"]] == [11, 11]  # a value a pair of frames


def test_the_load_tests_captions_name_their_triple():
    assert sf.caption_triple("a red ball moving right") == ("red", "ball", "right")
    assert sf.caption_triple("a purple triangle standing still") == ("purple", "triangle", "still")
    assert sf.caption_triple("a red fox running through snow") is None
    assert sf.caption_triple("a teal ball rising") is None  # no palette colour
    words = vocabulary()
    for i in range(20):
        for change in range(3):
            assert sf.caption_triple(viewer_prompt(i, change, True, words)) is not None


# ---------------------------------------------------------------- churn


def test_a_slots_plan_is_bounded_ordered_and_churns_as_asked():
    cfg = ChurnConfig(run_s=3600.0)
    plan = slot_plan(3, 16, cfg)
    assert [e.t for e in plan] == sorted(e.t for e in plan) and plan[-1].t == 3600.0
    opens = [e for e in plan if e.act is Act.OPEN]
    closes = [e for e in plan if e.act is Act.CLOSE]
    assert len(opens) == len(closes) == len(sessions(3, 16, cfg)) >= 6  # a reconnect every 8 minutes or so
    for o, c in zip(opens, closes):  # each session's events lie within it
        inside = [e for e in plan if e.session == o.session]
        assert inside[0] is o and inside[-1] is c and all(o.t <= e.t <= c.t for e in inside)
    prompts = [e.t for e in plan if e.act is Act.PROMPT]
    gaps = np.diff(prompts)
    assert 100 <= len(prompts) <= 250 and gaps.min() >= 2.5  # every 30 s, bursts of one every 5 s
    assert np.sum(np.isclose(gaps, 5.0)) >= 30  # the bursts
    pauses = list(zip([e.t for e in plan if e.act is Act.PAUSE], [e.t for e in plan if e.act is Act.RESUME]))
    assert 10 <= len(pauses) <= 15 and all(n - p == pytest.approx(15.0) for p, n in pauses)  # resume follows
    assert not any(p <= t < r for p, r in pauses for t in prompts)  # no prompt while paused
    watches = [e for e in plan if e.act is Act.WATCH]
    assert len(watches) >= 30 and all(0 < e.length_s <= 45.0 for e in watches)


def test_slots_run_at_their_own_phase_and_a_scale_shortens_every_period():
    a, b = slot_plan(0, 4, ChurnConfig(run_s=600.0)), slot_plan(2, 4, ChurnConfig(run_s=600.0))
    assert [e.t for e in a if e.act is Act.PROMPT][:3] != [e.t for e in b if e.act is Act.PROMPT][:3]
    fast = slot_plan(0, 1, ChurnConfig(run_s=60.0, scale=0.1))  # an hour's 30 s prompt period: 3 s
    assert len([e for e in fast if e.act is Act.PROMPT]) >= 15
    none = slot_plan(0, 1, ChurnConfig(run_s=600.0, watchers=0))
    assert not [e for e in none if e.act is Act.WATCH]


@pytest.mark.parametrize("bad", [dict(prompt_every_s=0), dict(burst_every_s=60.0), dict(burst_s=400.0),
                                 dict(pause_s=300.0), dict(watch_s=100.0), dict(watchers=-1), dict(scale=0)])
def test_a_churn_that_makes_no_sense_is_refused_with_its_values(bad):
    with pytest.raises(ValueError):
        ChurnConfig(run_s=60.0, **bad)


# ---------------------------------------------------------------- the summary and a run


def record(t, rss, latency_buckets=None, stalls=(0, 0.0, 100.0), tables=None):
    rec = {"t_s": t, "tables": tables or {}, "_stalls": stalls, "_watcher_stalls": (0, 0.0, 0.0)}
    return rec | {f: None for f in soak.SERVER} | {"rss_bytes": rss, "fds": 20.0}


def test_the_summary_checks_growth_latency_stalls_and_pixels():
    def scrape(fast: float, slow: float) -> dict:  # cumulative: `fast` chunks in (0, 0.1], `slow` in (0.1, 0.2]
        return {"streamsvc_chunk_latency_seconds_bucket{le=0.1}": fast,
                "streamsvc_chunk_latency_seconds_bucket{le=0.2}": fast + slow,
                "streamsvc_chunk_latency_seconds_bucket{le=inf}": fast + slow}

    # every minute 100 fast chunks and 10 slow ones, 30 slow ones a minute from minute 51 on
    slow = np.cumsum([0] + [30 if k > 50 else 10 for k in range(1, 61)])
    scrapes = [(60.0 * k, scrape(100.0 * k, float(slow[k]))) for k in range(61)]
    records = [record(60.0 * k, 1000.0 + (50.0 if k > 50 else 0.0), tables={"sessions": 4.0}) for k in range(1, 61)]
    records[-1]["_stalls"] = (2, 4.8, 16 * 3600.0 - 4.8)  # 16 stream-hours, 0.3 s of stall each
    samples = Samples(all=[(float(t), 1.0 if t < 3000 else 0.97) for t in range(0, 3600, 10)])
    r = soak.summarize(records, scrapes, samples, 3600.0, 60.0, score_pixels=True, own=(1, 0.5))
    assert r["growth"]["rss_bytes"]["relative"] == pytest.approx(0.05)  # 1000 at minute 5, 1050 at the end
    assert r["growth"]["tables"]["sessions"]["change"] == 0.0
    assert r["checks"]["rss_growth_under_5pct"] is False
    assert r["latency_p95"]["early_s"] == pytest.approx(0.145, abs=1e-4)  # rank 104.5 of 110: 4.5 / 10 into the slow
    assert r["latency_p95"]["late_s"] == pytest.approx(0.1783, abs=1e-4)  # rank 123.5 of 130: 23.5 / 30
    assert r["checks"]["latency_p95_within_10pct"] is False
    assert r["stalls"]["per_stream_hour_s"] == pytest.approx(0.3, abs=1e-3) and r["stalls"]["count"] == 2
    assert r["checks"]["stall_ratio_at_most_1e-4"] is True
    assert r["stalls"]["during_own_pauses"] == 1 and r["stalls"]["ratio_outside_own_pauses"] == pytest.approx(4.3 / 57600, rel=1e-3)
    records[-1]["_stalls"] = (9, 7.2, 16 * 3600.0 - 7.2)  # 0.45 s a stream-hour, 2 s of it in the soak's own pauses
    r2 = soak.summarize(records, scrapes, samples, 3600.0, 60.0, score_pixels=True, own=(3, 2.0))
    assert r2["checks"]["stall_ratio_at_most_1e-4"] is False
    assert r2["checks"]["stall_ratio_outside_own_pauses_at_most_1e-4"] is True
    assert r["drift"]["all"]["delta"] == pytest.approx(-0.03) and r["checks"]["pixels_within_2_points"] is False
    assert r["checks"]["pixels_same_prompts_within_2_points"] is None  # no chunk scored with its prompt
    assert r["checks"]["pixels_same_prompts_and_history_within_2_points"] is None
    assert "colour" not in soak.summarize(records, scrapes, samples, 3600.0, 60.0, score_pixels=False)["drift"]


def test_without_matplotlib_no_png_is_made_and_a_line_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    assert soak.plot([{"minute": 1, "rss_bytes": 1.0}], tmp_path) == []
    assert "matplotlib is not installed: no PNGs" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_a_png_of_each_curve_where_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    minutes = [{"minute": k, **{f: None for f in soak.SERVER}, "rss_bytes": 1e9 + k, "fds": 20.0, "tables": {"s": 1.0},
                "latency": {"p50_s": 0.02, "p95_s": 0.05, "max_s": None}, "stalls": {"seconds": 0.0},
                "degraded": None, "frames": {"brightness": 60.0, "saturation": 0.1, "sharpness": 30.0, "change": 2.0},
                "pixels": None} for k in (1, 2, 3)]
    paths = soak.plot(minutes, tmp_path)
    names = {p.rsplit("/", 1)[1] for p in paths}
    assert {"rss_bytes.png", "fds.png", "latency_p95_s.png", "frame_sharpness.png", "table_s.png"} <= names
    assert "overview.png" in names  # the main curves side by side (those with points: server RSS, p95, sharpness)
    assert "gpu_allocated_bytes.png" not in names and "latency_max_s.png" not in names  # no points: no PNG
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("decode", ["inline", "thread"])  # where the sampled slots decode: either reads the frames
def test_a_short_soak_against_a_local_server_ends_with_its_json_line(tmp_path, capsys, decode):
    report = soak.main(["--streams", "2", "--minutes", "3", "--minute-s", "8", "--session-s", "120",
                        "--decode", decode, "--out", str(tmp_path)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(json.dumps(report))  # the last line is the report
    assert sum(line.startswith("[min ") for line in lines) == 3
    assert len(report["minutes"]) == 3 and report["config"]["streams"] == 2 and report["config"]["decode"] == decode
    for m in report["minutes"]:
        assert m["scraped"] and m["rss_bytes"] > 0 and m["fds"] > 0 and m["threads"] >= 2
        assert m["encoders"] >= 1 and m["encoder_rss_bytes"] > 0  # the CPU server's x264 processes
        assert m["latency"]["chunks"] > 0 and 0 < m["latency"]["p50_s"] <= m["latency"]["p95_s"]
        assert m["frames"]["n"] > 0 and m["pixels"]["frames"] >= 0 and "degraded" in m
        assert m["gpu_allocated_bytes"] is None  # a CPU server has none
    churn = report["churn"]
    assert churn["sessions"] >= 4 and churn["prompts"] >= 8 and churn["watchers"] >= 1  # reconnects, prompts, watchers
    assert churn["pauses"] == churn["resumes"] >= 1 and churn["failed"] == 0
    assert report["stalls"]["count"] >= 0 and report["stalls"]["ratio"] is not None
    assert set(report["checks"]) == {"stall_ratio_at_most_1e-4", "stall_ratio_outside_own_pauses_at_most_1e-4",
                                     "rss_growth_under_5pct", "latency_p95_within_10pct", "pixels_within_2_points",
                                     "pixels_same_prompts_within_2_points",
                                     "pixels_same_prompts_and_history_within_2_points"}
    own = report["host"]["stalls_during_own_pauses"]
    assert 0 <= own["stalls"]["count"] <= report["stalls"]["count"] and own["watcher_stalls"]["count"] >= 0
    assert report["latency_p95"]["early_s"] > 0 and report["latency_p95"]["late_s"] > 0
    assert report["growth"]["rss_bytes"]["start"] > 0 and report["after_close"]["fds"] > 0
    for name in ("brightness", "saturation", "sharpness", "change", "all", "all_same_prompts",
                 "all_same_prompts_and_history"):
        assert report["drift"][name]["delta"] is not None, name
    assert report["sampling"]["frames_read"] > 0 and (tmp_path / "soak.json").exists()
    assert report["sampling"]["pixels_by_chunks_since_switch"]  # the built-in model's frames, scored


def test_stalls_that_overlap_the_soaks_own_loop_pauses_are_counted_apart():
    from client.loadtest_host import overlapping

    pauses = [(10.0, 0.3), (50.0, 0.1)]  # (start, length) on the monotonic clock
    stalls = [(10.2, 0.2), (9.0, 0.5), (49.9, 0.15), (50.1, 0.05), (70.0, 1.0)]  # the 1st, 3rd overlap; 4th touches
    count, seconds = overlapping(stalls, pauses)
    assert count == 2 and seconds == pytest.approx(0.35)
    assert overlapping(stalls, []) == (0, 0)


def test_viewing_keeps_the_stall_events_of_ended_sessions_on_the_monotonic_clock():
    from types import SimpleNamespace

    from benchmarks.soak_streams import Viewing

    stats = SimpleNamespace(stalls=2, stall_s=0.5, play_s=100.0)
    a = SimpleNamespace(connected_at=1000.0, stall_events=[(30.0, 0.2), (60.0, 0.3)], stats=lambda: stats)
    b = SimpleNamespace(connected_at=None, stall_events=[], stats=lambda: None)  # never connected
    viewing = Viewing(open=[a, b])
    assert viewing.stall_events() == [(1029.8, 0.2), (1059.7, 0.3)]
    viewing.fold(a)
    viewing.fold(b)
    assert viewing.open == [] and viewing.stall_events() == [(1029.8, 0.2), (1059.7, 0.3)]
    assert viewing.totals() == (2, 0.5, 100.0)
