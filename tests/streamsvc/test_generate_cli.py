import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from models import build_generator
from streamsvc.cli import main


def decode(path):
    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.name == "h264"
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def test_generate_writes_h264_and_is_deterministic(tmp_path, capsys):
    # random weights: a trained model may draw the same frames from other noise
    args = ["generate", "--prompt", "a cat on a roof", "--seconds", "3", "--fps", "16", "--quiet", "--device", "cpu",
            "--weights", "random"]
    assert main(args + ["--seed", "1", "-o", str(tmp_path / "a.mp4"), "--prompt-at", "1.5:a dog"]) == 0
    assert main(args + ["--seed", "1", "-o", str(tmp_path / "b.mp4"), "--prompt-at", "1.5:a dog"]) == 0
    assert main(args + ["--seed", "2", "-o", str(tmp_path / "c.mp4"), "--prompt-at", "1.5:a dog"]) == 0
    a, b, c = (decode(tmp_path / f"{n}.mp4") for n in "abc")
    assert len(a) == 48 and len(a) >= 40
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert "wrote 48 frames" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["1.5", "x:dog", "-1:dog", "2:"])
def test_bad_prompt_at_is_a_clear_error(tmp_path, capsys, bad):
    code = main(["generate", "--prompt", "p", "-o", str(tmp_path / "x.mp4"), f"--prompt-at={bad}"])
    assert code == 2
    assert "--prompt-at wants SECONDS:TEXT" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory):
    """A model file in the shipped layout (a smoke run's export), to stand in for the built-in one."""
    from models.train import Trainer, TrainConfig

    out = tmp_path_factory.mktemp("train")
    trainer = Trainer(TrainConfig.smoke(), out, torch.device("cpu"))
    assert trainer.run(minutes=5, save_minutes=60)
    trainer.export(out / "tiny.safetensors")
    return out / "tiny.safetensors"


def test_generate_defaults_to_the_built_in_model_and_writes_a_strip(tmp_path, capsys, monkeypatch, smoke_model):
    from models import model_file

    monkeypatch.setattr(model_file, "BUILTIN_WEIGHTS", smoke_model)
    args = ["generate", "--prompt", "a red ball moving right", "--seconds", "1", "--quiet", "--device", "cpu"]
    assert main(args + ["-o", str(tmp_path / "d.mp4"), "--strip", str(tmp_path / "s.png"), "--strip-every", "4"]) == 0
    assert main(args + ["-o", str(tmp_path / "b.mp4"), "--weights", "builtin"]) == 0
    assert main(args + ["-o", str(tmp_path / "r.mp4"), "--weights", "random"]) == 0
    d, b, r = (decode(tmp_path / f"{n}.mp4") for n in "dbr")
    assert len(d) == 16 and all(np.array_equal(x, y) for x, y in zip(d, b))
    assert not all(np.array_equal(x, y) for x, y in zip(d, r))
    with av.open(str(tmp_path / "s.png")) as c:
        strip = next(c.decode(video=0)).to_ndarray(format="rgb24")
    assert strip.shape == (128, 4 * 128 + 3 * 2, 3)  # frames 0, 4, 8, 12, 2 px apart
    gen = build_generator("tiny", weights="builtin")  # the frames themselves (the MP4 holds x264's copies)
    frames = next(gen.stream(gen.open_stream("s", "a red ball moving right", seed=0))).frames.numpy()
    for i, k in enumerate((0, 4, 8)):
        assert np.array_equal(strip[:, i * 130 : i * 130 + 128], frames[k])
    assert (strip[:, 128:130] == 255).all()
    assert "wrote a strip of frames 0, 4, ... to" in capsys.readouterr().out


@pytest.mark.skipif(not Path("models/assets/tiny.safetensors").is_file(), reason="the built-in model file is not here")
def test_generate_starts_from_an_image(tmp_path, capsys):
    """--image: the picture (any size: centre-cropped and scaled) is the video's first frame, then the prompt's motion."""
    from streamsvc.inputs.offline import read_image
    from streamsvc.offline import write_strip

    picture = np.empty((192, 256, 3), np.uint8)  # cropped to its middle 192 x 192, scaled to 128 x 128
    picture[:] = (235, 215, 175)
    picture[99:141, 81:123] = (20, 170, 160)  # a teal square on beige
    write_strip([picture], tmp_path / "start.png")
    args = ["generate", "--prompt", "a green square moving right", "--seconds", "1", "--quiet", "--device", "cpu",
            "--image", str(tmp_path / "start.png"), "-o", str(tmp_path / "i.mp4")]
    assert main(args) == 0
    frames = decode(tmp_path / "i.mp4")
    want = read_image(tmp_path / "start.png", 128, 128).numpy()
    assert (want[66:94, 34:61] == (20, 170, 160)).all() and (want[:, :30] == (235, 215, 175)).all()  # scaled 2/3, cropped
    mse = np.mean((frames[0].astype(float) - want) ** 2)
    assert len(frames) == 16 and 10 * np.log10(255**2 / mse) >= 25
    assert "wrote 16 frames" in capsys.readouterr().out
    assert main(args + ["--dump", str(tmp_path / "d.pt")]) == 2
    assert "--image goes without --input, --parallel and --dump" in capsys.readouterr().err
    assert main(args[:-4] + ["--image", str(tmp_path / "none.png"), "-o", str(tmp_path / "x.mp4")]) == 2
    assert "cannot read the image" in capsys.readouterr().err


def test_prompt_changes_count_an_image_as_a_one_frame_chunk():
    from streamsvc.offline import chunk_for_time

    gen = build_generator("tiny", device="cpu", weights="random")
    assert [chunk_for_time(gen, s, 16) for s in (0, 0.5, 1)] == [0, 1, 2]  # chunks start at frames 0, 9, 21
    assert [chunk_for_time(gen, s, 16, image=True) for s in (0, 0.5, 1)] == [0, 2, 3]  # at frames 0, 1, 13, 25


def test_a_missing_model_file_is_a_clear_error_not_a_traceback(tmp_path, monkeypatch, capsys):
    from models import model_file

    monkeypatch.setattr(model_file, "BUILTIN_WEIGHTS", tmp_path / "assets" / "tiny.safetensors")
    assert main(["generate", "--prompt", "p", "-o", str(tmp_path / "x.mp4"), "--quiet", "--weights", "builtin"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamsvc generate: the built-in model's weights are missing") and "--weights random" in err
    assert main(["serve", "--port", "0", "--weights", "builtin"]) == 2  # before the server starts
    assert "streamsvc serve: the built-in model's weights are missing" in capsys.readouterr().err
    # the default (auto) without the file: random weights, as --weights random, and a warning in the log
    assert main(["generate", "--prompt", "p", "-o", str(tmp_path / "a.mp4"), "--quiet", "--seconds", "1"]) == 0
    assert main(["generate", "--prompt", "p", "-o", str(tmp_path / "r.mp4"), "--quiet", "--seconds", "1", "--weights", "random"]) == 0
    assert all(np.array_equal(x, y) for x, y in zip(decode(tmp_path / "a.mp4"), decode(tmp_path / "r.mp4")))
    capsys.readouterr()
    (tmp_path / "x.pt").write_bytes(b"")  # there (a missing one is said first: tests/streamsvc/test_preflight.py)
    assert main(["generate", "--prompt", "p", "--weights", "random", "--checkpoint", str(tmp_path / "x.pt"),
                 "--quiet"]) == 2
    assert "random DiT weights, but a checkpoint was given too" in capsys.readouterr().err


def test_generate_the_14b_preset_from_a_sharded_wan_folder_whose_config_gives_the_heads(tmp_path, capsys):
    """A small DiT in Wan2.1-T2V-14B's layout (3 shards and their index, config.json): 3 heads of 32, which
    its dim 96 does not tell (the preset's heads are 128 wide); the preset's 480x832."""
    from models import CausalWanModel, ModelConfig
    from tests.models.test_weights import wan_dir

    mc = ModelConfig.from_name("wan2.1-14b", dim=96, num_heads=3, ffn_dim=128, num_layers=2, text_dim=32)
    d = wan_dir(tmp_path, CausalWanModel(mc).init_weights(3), heads=3, shards=3)
    assert (d / "diffusion_pytorch_model.safetensors.index.json").is_file()
    args = ["generate", "--prompt", "a fox", "--seconds", "0.5", "--preset", "wan2.1-14b", "--checkpoint", str(d),
            "--device", "cpu", "--quiet"]
    assert main(args + ["-o", str(tmp_path / "a.mp4")]) == 0
    assert "wrote 8 frames (832x480, 16 fps, H.264)" in capsys.readouterr().out
    assert len(decode(tmp_path / "a.mp4")) == 8
    config = json.loads((d / "config.json").read_text())
    del config["num_heads"]  # a config that does not say: the heads are undecidable
    (d / "config.json").write_text(json.dumps(config))
    assert main(args + ["-o", str(tmp_path / "b.mp4")]) == 2
    err = capsys.readouterr().err
    assert "cannot tell the DiT's attention heads: its dim 96 is not a multiple of the 'wan2.1-14b' preset's head " \
           "width 128, and no config.json says num_heads" in err and "Traceback" not in err
