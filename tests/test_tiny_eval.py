"""benchmarks/tiny_eval.py: its scoring on perfect frames (the renderer's own), and a quick run on random weights."""

import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import tiny_eval as te
from models import WorkKind
from models.decoder import frames_per_chunk
from models.scenes import HELD_OUT, Scene, Timeline


class RenderedScenes:
    """A stand-in for ChunkGenerator whose chunks (of `fpc` latent frames) are the renderer's frames of what the
    captions ask for."""

    def __init__(self, captions: dict[str, tuple[str, str, str]], fpc: int = 3) -> None:
        self.captions = captions  # caption -> its triple
        self.model_cfg = SimpleNamespace(width=128, height=128, dim=0, num_layers=0, num_heads=0)
        self.cfg = SimpleNamespace(frames_per_chunk=fpc)
        self.made: list[int] = []  # chunks each stream made, as it closes

    def frames_in_chunk(self, c: int) -> int:
        return frames_per_chunk(self.cfg.frames_per_chunk, c == 0)

    def open_stream(self, sid, prompt, seed):
        return SimpleNamespace(segments=[(0, self.scene(prompt), prompt)], pending=None, chunk=0)

    def scene(self, prompt: str) -> Scene:
        colour, shape, motion = self.captions[prompt]
        return Scene(colour, shape, motion=motion)

    def set_prompt(self, s, prompt) -> None:
        s.pending = prompt

    def next_work(self, s) -> WorkKind:
        return WorkKind.COMMIT

    def run(self, work: WorkKind, states):
        if work is WorkKind.RECACHE:
            for s in states:
                s.segments.append((s.chunk, self.scene(s.pending), s.pending))
            return [None] * len(states)
        out = []
        for s in states:
            first = sum(self.frames_in_chunk(c) for c in range(s.chunk))
            timeline = Timeline(tuple(s.segments), frames_per_chunk=self.cfg.frames_per_chunk)
            frames = timeline.render(range(first, first + self.frames_in_chunk(s.chunk)))
            out.append(SimpleNamespace(frames=frames))
            s.chunk += 1
        return out

    def close_stream(self, s) -> None:
        self.made.append(s.chunk)


def perfect_captions() -> dict[str, tuple[str, str, str]]:
    captions = {te.caption(t, seed): t for t in te.TRIPLES for seed in [*range(2), *range(1000, 1003)]}
    return captions | {te.caption(te.switched_to(t, seed), seed): te.switched_to(t, seed) for t in te.TRIPLES for seed in range(2)}


@pytest.mark.parametrize("fpc", [3, 1])
def test_perfect_frames_score_full_marks_and_switch_at_once(capsys, fpc):
    args = te.parse_args(["--seeds", "2", "--triples", "15", "--drift-streams", "3", "--drift-chunks", "24",
                          "--chunk-latent-frames", str(fpc)])
    picked = te.spread(te.TRIPLES, 15)
    gen = RenderedScenes(perfect_captions(), fpc)
    result = te.evaluate(gen, args, 0.0)
    assert sorted(set(gen.made)) == [12 * 3 // fpc, 24 * 3 // fpc]  # chunks of 1: three for each of the counts' chunks
    assert result["chunk_latent_frames"] == fpc and (result["chunks"], result["switch_at"]) == (12, 6)
    for row in result["accuracy"].values():
        assert row == {"colour": 1.0, "shape": 1.0, "motion": 1.0, "all": 1.0}
    lat = result["switch_latency_frames"]
    assert lat["hist"]["0-2"] == 2 * 15 and lat["never"] == 0 and lat["within_first_chunk"] == 1.0 and lat["p95"] == 0
    assert result["drift"]["size_ratio"] == 1.0 and result["drift"]["late"]["all"] == 1.0
    assert result["triples"] == 15 and result["held_out_triples"] == sum(t in HELD_OUT for t in picked) > 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == result
    assert "* white ball right" in out  # held-out triples are marked


def test_both_chunk_sizes_score_the_same_video_and_time_the_switch_by_their_own_chunk(capsys):
    """Chunks of 1 make the video chunks of 3 do, frame for frame: the same scores, the same object sizes. A switch
    shown two chunks of 1 late is 8 frames late, not within the first chunk (4 frames), and leaves the accuracy
    as it was: the chunk of 3 it lands in is not scored, at either size."""
    argv = ["--seeds", "1", "--triples", "6", "--drift-streams", "2", "--drift-chunks", "13", "--chunks", "6", "--switch-at", "3"]
    results = {}
    for fpc in (3, 1):
        gen = RenderedScenes(perfect_captions(), fpc)
        results[fpc] = te.evaluate(gen, te.parse_args([*argv, "--chunk-latent-frames", str(fpc)]), 0.0)
    same = lambda r: {k: v for k, v in r.items() if k not in ("chunk_latent_frames", "seconds")}  # noqa: E731
    assert same(results[3]) == same(results[1])

    class Late(RenderedScenes):  # the new prompt shows two chunks after the switch
        def run(self, work, states):
            if work is WorkKind.RECACHE:
                for s in states:
                    s.segments.append((s.chunk + 2, self.scene(s.pending), s.pending))
                return [None] * len(states)
            return super().run(work, states)

    late = te.evaluate(Late(perfect_captions(), 1), te.parse_args([*argv, "--chunk-latent-frames", "1"]), 0.0)
    lat = late["switch_latency_frames"]
    assert lat["p50"] == lat["p95"] == 8 and lat["hist"]["6-8"] == 6 and lat["within_first_chunk"] == 0.0  # chunks of 4 frames
    assert late["accuracy"] == results[1]["accuracy"]
    with pytest.raises(SystemExit):
        te.parse_args(["--chunk-latent-frames", "2"])


def test_every_triple_is_switched_to_once_per_seed_and_to_a_new_colour():
    for seed in range(8):
        targets = [te.switched_to(t, seed) for t in te.TRIPLES]
        assert sorted(targets) == sorted(te.TRIPLES)
        assert all(a[0] != b[0] for a, b in zip(te.TRIPLES, targets))


@pytest.mark.slow
@pytest.mark.parametrize("fpc", [3, 1])
def test_a_quick_run_on_random_weights_scores_low(fpc):
    torch.set_num_threads(1)
    r = te.main(["--weights", "random", "--seeds", "1", "--triples", "4", "--chunks", "4", "--switch-at", "2",
                 "--drift-streams", "0", "--threads", "1", "--chunk-latent-frames", str(fpc)])
    assert r["triples"] == 4 and r["model"]["dim"] == 64 and r["chunk_latent_frames"] == fpc
    assert r["accuracy"]["before_switch_seen"]["all"] < 0.5
