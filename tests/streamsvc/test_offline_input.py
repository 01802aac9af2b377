"""`streamsvc generate --input FILE --strength S` (issue 35): the file decoded with PyAV, centre-cropped and
scaled to the model's size, resampled to the stream's fps, each chunk's frames restyled. CPU, random weights."""

import av
import numpy as np
import pytest
import torch

from models import build_generator
from models.scenes import Scene, Timeline
from streamsvc.cli import main
from streamsvc.inputs.offline import InputVideo, open_input


def write_video(path, frames: np.ndarray, fps: int) -> None:
    with av.open(str(path), mode="w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.height, s.width, s.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        s.options = {"crf": "10"}
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def counter_video(n: int, h: int = 32, w: int = 48) -> np.ndarray:
    """Frame i is flat grey level 8 i (readable after H.264)."""
    return np.stack([np.full((h, w, 3), 8 * i, np.uint8) for i in range(n)])


def levels(frames: torch.Tensor) -> list[int]:
    return [round(float(f.float().mean()) / 8) for f in frames]


@pytest.mark.parametrize("file_fps, want", [
    (32, dict(levels=[1, 3, 5, 7, 9, 11, 13, 15], dropped=8, repeated=0, padded=0)),  # twice the stream's: the newer wins
    # half: each slot with none repeats; the last slot, after the last frame's time, pads the file's end
    (8, dict(levels=[0, 0, 1, 1, 2, 2, 3, 3], dropped=0, repeated=3, padded=1)),
])
def test_resampled_to_the_streams_fps_by_time(tmp_path, file_fps, want):
    n = 16 if file_fps == 32 else 4
    write_video(tmp_path / "in.mp4", counter_video(n), file_fps)
    with InputVideo(tmp_path / "in.mp4", 48, 32, fps=16) as v:
        got = v.chunk(8)
        assert got.shape == (8, 32, 48, 3) and got.dtype == torch.uint8
        assert levels(got) == want["levels"]
        assert (v.counts.dropped, v.counts.repeated, v.counts.padded) == (want["dropped"], want["repeated"], want["padded"])
        assert v.chunk(8) is None and v.counts.missing_chunks == 1  # after the file's end: no input


def test_centre_crop_to_the_models_aspect_then_scale(tmp_path):
    # 256x128 (2:1) into the model's 128x128: the centre 128x128 kept (green), the side bands (red) cropped off
    frame = np.zeros((128, 256, 3), np.uint8)
    frame[:, :64] = frame[:, 192:] = (230, 30, 30)
    frame[:, 64:192] = (30, 200, 50)
    write_video(tmp_path / "wide.mp4", np.stack([frame] * 9), 16)
    with InputVideo(tmp_path / "wide.mp4", 128, 128, fps=16) as v:
        got = v.chunk(9).numpy().astype(int)
    assert np.abs(got[:, 4:-4, 4:-4] - (30, 200, 50)).max() < 12  # no red anywhere inside


def test_generate_restyles_the_input_and_a_model_without_an_encoder_refuses(tmp_path, capsys):
    mc = build_generator("tiny", weights="random").model_cfg
    tl = Timeline(((0, Scene("red", "ball", motion="right"), "a red ball moving right"),), mc.height, mc.width)
    write_video(tmp_path / "in.mp4", tl.render(range(21)).numpy(), 16)  # two chunks' worth (9 + 12 frames)
    base = ["generate", "--prompt", "a blue ball", "--seconds", "2", "--fps", "16", "--quiet", "--device", "cpu",
            "--weights", "random", "--seed", "1"]
    assert main(base + ["-o", str(tmp_path / "t2v.mp4"), "--dump", str(tmp_path / "t2v.pt")]) == 0
    assert main(base + ["-o", str(tmp_path / "v2v.mp4"), "--dump", str(tmp_path / "v2v.pt"), "--input",
                        str(tmp_path / "in.mp4"), "--strength", "0.6"]) == 0
    out = capsys.readouterr()
    assert "strength 0.6 snaps to 0.625" in out.err
    assert "21 frames decoded, 21 at 16 fps" in out.out and "1 chunks after its end as text-to-video" in out.out
    t2v, v2v = torch.load(tmp_path / "t2v.pt"), torch.load(tmp_path / "v2v.pt")
    assert v2v["frames"].shape == t2v["frames"].shape == (32, 128, 128, 3)
    assert not torch.equal(v2v["latents"][0], t2v["latents"][0])  # the input's chunks differ
    with av.open(str(tmp_path / "v2v.mp4")) as c:
        assert sum(1 for _ in c.decode(video=0)) == 32
    # at strength 1.0 the input is pure noise: the same frames as without it
    assert main(base + ["-o", str(tmp_path / "one.mp4"), "--dump", str(tmp_path / "one.pt"), "--input",
                        str(tmp_path / "in.mp4"), "--strength", "1"]) == 0
    assert torch.equal(torch.load(tmp_path / "one.pt")["frames"], t2v["frames"])
    # refusals, with the reason
    gen = build_generator("tiny", weights="random")
    bare = type(gen)(gen.model, gen.cfg, gen.text_encoder, gen.decoder)
    with pytest.raises(ValueError, match="needs a model with an encoder"):
        open_input(bare, str(tmp_path / "in.mp4"), 0.6, 16)
    with pytest.raises(ValueError, match="strength must be in"):
        open_input(gen, str(tmp_path / "in.mp4"), 1.5, 16)
    assert main(base + ["-o", str(tmp_path / "x.mp4"), "--input", str(tmp_path / "nope.mp4")]) == 2
    assert "cannot read the input video" in capsys.readouterr().err
    assert main(base + ["-o", str(tmp_path / "x.mp4"), "--input", str(tmp_path / "in.mp4"), "--parallel", "2"]) == 2
    assert "--input runs on one process" in capsys.readouterr().err


def test_a_file_over_the_pixel_cap_is_refused_with_one_line_before_a_frame_is_decoded(tmp_path, capsys, monkeypatch):
    write_video(tmp_path / "wide.mp4", np.zeros((2, 64, 2000, 3), np.uint8), 16)  # 2000 wide: over 1920 a side
    decoded = []
    real_decode = av.container.InputContainer.decode
    monkeypatch.setattr(av.container.InputContainer, "decode",
                        lambda self, *a, **k: decoded.append(1) or real_decode(self, *a, **k))
    with pytest.raises(ValueError, match="2000x64") as refused:
        InputVideo(tmp_path / "wide.mp4", 128, 128, fps=16)
    assert "1920x1080" in str(refused.value) and "\n" not in str(refused.value) and not decoded
    base = ["generate", "--prompt", "a blue ball", "--seconds", "1", "--fps", "16", "--quiet", "--device", "cpu",
            "--weights", "random", "-o", str(tmp_path / "x.mp4")]
    assert main(base + ["--input", str(tmp_path / "wide.mp4")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("streamsvc generate: the input wide.mp4: a video of 2000x64") and "Traceback" not in err


def test_a_frame_over_the_cap_later_in_the_file_ends_its_input_there(tmp_path):
    from tests.streamsvc.test_bitstream import x264

    # an Annex-B file whose second stream is over the cap, past what opening the file probes (its first frames)
    small, wide = x264(48, 32, 400), x264(2000, 64, 2)
    (tmp_path / "resize.h264").write_bytes(b"".join(small + wide))
    with InputVideo(tmp_path / "resize.h264", 48, 32, fps=16) as v:
        while v.chunk(64) is not None:
            pass
        assert v.counts.decoded == 400 and "2000x64" in v.counts.refused and "ended early" in v.summary()
