"""benchmarks/start_image.py: its scoring on made-up streams (the image moved as asked; one snapped to a palette),
and a quick run of the shipped model."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks import start_image as si
from models.model_file import BUILTIN_WEIGHTS


class Moved:
    """A stand-in for ChunkGenerator: its first frame is the image, then the image rolled `speed` px a frame the
    way the case asks; `look` recolours the frames after the first (object, background)."""

    def __init__(self, case: si.Case, speed: int = 3, look=None) -> None:
        self.case, self.speed, self.look = case, speed, look
        self.model_cfg = SimpleNamespace(width=128, height=128)
        self.cfg = SimpleNamespace(frames_per_chunk=3)

    def open_stream(self, sid, prompt, seed, input_kind=None):
        assert prompt == self.case.prompt and input_kind == "image"  # a start image's stream, as the server opens it
        return SimpleNamespace(image=None)

    def start_from_image(self, state, image):
        state.image = image.numpy()
        return SimpleNamespace(frames=image[None])

    def stream(self, state):
        dx, dy = si.DIRECTIONS[self.case.motion]
        n = 1
        while True:
            frames = []
            for _ in range(12):
                f = np.roll(state.image, (dy * self.speed * n, dx * self.speed * n), axis=(0, 1))
                if self.look is not None:
                    f = np.where((f == self.case.colour).all(-1, keepdims=True), self.look[0], self.look[1]).astype(np.uint8)
                frames.append(f)
                n += 1
            yield SimpleNamespace(frames=torch.from_numpy(np.stack(frames)))

    def close_stream(self, state):
        pass


@pytest.mark.parametrize("case", si.CASES, ids=lambda c: c.name)
def test_the_image_moved_as_asked_scores_full_marks(case):
    r = si.run(Moved(case), case, seed=0, frames=36)
    assert r.psnr_db == 100.0 and r.windows == 3 and r.moves == 1.0
    assert r.speed_px == pytest.approx(3.0, abs=0.01) and r.start_offset_px == pytest.approx(3.0, abs=0.5)
    assert r.object_rgb_error < 1 and r.background_rgb_error < 1
    s = si.summary([r])
    assert s["first_frame_ok"] and s["moves_ok"] and s["keeps_look"]


def test_a_stream_still_or_snapped_to_a_palette_fails_what_it_misses():
    case = si.CASES[0]
    still = si.run(Moved(case, speed=0), case, seed=0, frames=36)
    assert still.moves == 0.0 and not si.summary([still])["moves_ok"]
    snapped = si.run(Moved(case, look=((30, 200, 50), (60, 60, 60))), case, seed=0, frames=36)
    assert snapped.moves == 1.0 and snapped.object_rgb_error > 40 and snapped.background_rgb_error > 200
    assert not si.summary([snapped])["keeps_look"]


@pytest.mark.skipif(not BUILTIN_WEIGHTS.is_file(), reason="the built-in model file is not in this checkout")
def test_a_quick_run_ends_with_one_json_line(capsys):
    out = si.main(["--seeds", "1", "--frames", "24", "--cases", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1]) == json.loads(json.dumps(out))
    assert set(out["chunk_sizes"]) == {"3", "1"} and len(out["rows"]) == 2
    assert all(s["first_frame_ok"] for s in out["chunk_sizes"].values())  # the shipped decoder gives the image back
