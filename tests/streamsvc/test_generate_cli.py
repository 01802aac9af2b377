import av
import numpy as np
import pytest

from streamsvc.cli import main


def decode(path):
    with av.open(str(path)) as c:
        assert c.streams.video[0].codec_context.name == "h264"
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def test_generate_writes_h264_and_is_deterministic(tmp_path, capsys):
    args = ["generate", "--prompt", "a cat on a roof", "--seconds", "3", "--fps", "16", "--quiet", "--device", "cpu"]
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
