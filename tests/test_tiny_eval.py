"""benchmarks/tiny_eval.py: its scoring on perfect frames (the renderer's own), and a quick run on random weights."""

import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import tiny_eval as te
from models import WorkKind
from models.scenes import HELD_OUT, Scene, Timeline


class RenderedScenes:
    """A stand-in for ChunkGenerator whose chunks are the renderer's frames of what the captions ask for."""

    def __init__(self, captions: dict[str, tuple[str, str, str]]) -> None:
        self.captions = captions  # caption -> its triple
        self.model_cfg = SimpleNamespace(width=128, height=128, dim=0, num_layers=0, num_heads=0)

    def frames_in_chunk(self, c: int) -> int:
        return 9 if c == 0 else 12

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
            frames = Timeline(tuple(s.segments)).render(range(first, first + self.frames_in_chunk(s.chunk)))
            out.append(SimpleNamespace(frames=frames))
            s.chunk += 1
        return out

    def close_stream(self, s) -> None:
        pass


def test_perfect_frames_score_full_marks_and_switch_at_once(capsys):
    args = te.parse_args(["--seeds", "2", "--triples", "15", "--drift-streams", "3", "--drift-chunks", "24"])
    captions = {te.caption(t, seed): t for t in te.TRIPLES for seed in [*range(2), *range(1000, 1003)]}
    captions |= {te.caption(te.switched_to(t, seed), seed): te.switched_to(t, seed) for t in te.TRIPLES for seed in range(2)}
    picked = te.spread(te.TRIPLES, 15)
    result = te.evaluate(RenderedScenes(captions), args, 0.0)
    for row in result["accuracy"].values():
        assert row == {"colour": 1.0, "shape": 1.0, "motion": 1.0, "all": 1.0}
    lat = result["switch_latency_frames"]
    assert lat["hist"]["0-2"] == 2 * 15 and lat["never"] == 0 and lat["within_first_chunk"] == 1.0 and lat["p95"] == 0
    assert result["drift"]["size_ratio"] == 1.0 and result["drift"]["late"]["all"] == 1.0
    assert result["triples"] == 15 and result["held_out_triples"] == sum(t in HELD_OUT for t in picked) > 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == result
    assert "* white ball right" in out  # held-out triples are marked


def test_every_triple_is_switched_to_once_per_seed_and_to_a_new_colour():
    for seed in range(8):
        targets = [te.switched_to(t, seed) for t in te.TRIPLES]
        assert sorted(targets) == sorted(te.TRIPLES)
        assert all(a[0] != b[0] for a, b in zip(te.TRIPLES, targets))


@pytest.mark.slow
def test_a_quick_run_on_random_weights_scores_low():
    torch.set_num_threads(1)
    r = te.main(["--weights", "random", "--seeds", "1", "--triples", "4", "--chunks", "4", "--switch-at", "2",
                 "--drift-streams", "0", "--threads", "1"])
    assert r["triples"] == 4 and r["model"]["dim"] == 64
    assert r["accuracy"]["before_switch_seen"]["all"] < 0.5
