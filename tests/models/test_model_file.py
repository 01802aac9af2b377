"""Whole model files (`python -m models.train --export`) and the built-in one shipped with the package."""

import tomllib
from dataclasses import replace
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch

from models import HashTextEncoder, build_generator
from models import model_file as M
from models import weights as W
from models.scenes import vocabulary
from models.text import VocabTextEncoder
from models.train import Trainer, TrainConfig

ROOT = Path(__file__).resolve().parents[2]
GROWN = "dim=96,num_heads=3,num_layers=3"  # not the preset's shapes: the file's metadata must win


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train")
    trainer = Trainer(replace(TrainConfig.smoke(), model=GROWN), out, torch.device("cpu"))
    assert trainer.run(minutes=5, save_minutes=60)
    trainer.export(out / "tiny.safetensors")
    return out / "tiny.safetensors"


def test_a_model_file_builds_its_dit_decoder_and_text_encoder(model_file):
    from safetensors.torch import load_file

    stored = load_file(str(model_file))
    gen = build_generator("tiny", weights=str(model_file))
    mc = gen.model_cfg
    assert (mc.dim, mc.num_heads, mc.num_layers) == (96, 3, 3)  # from the metadata, not the preset (64, 2, 2)
    for k, v in gen.model.state_dict().items():
        assert torch.equal(v, stored[f"dit.{k}"]), k
    for k, v in gen.decoder.state_dict().items():
        assert torch.equal(v, stored[f"decoder.{k}"]), k
    assert isinstance(gen.text_encoder, VocabTextEncoder)
    assert list(gen.text_encoder.vocabulary) == vocabulary()
    state = gen.open_stream("s", "a red ball moving right", seed=0)
    chunk = next(gen.stream(state))
    assert chunk.frames.shape == (9, 128, 128, 3) and chunk.frames.dtype == torch.uint8


def test_a_model_file_names_the_schedule_it_samples_with(model_file, tmp_path):
    """The export records the denoising levels (the recipe's `follow_timesteps` by default, so that
    `python -m models.train` alone makes the shipped kind of file, or `--timesteps`); the generator takes the file's
    levels for the default schedule, the first N of them for a steps-N one, and keeps a schedule written out by
    hand."""
    from models.stream import GeneratorConfig
    from models.train import main

    own = (1000.0, 500.0, 250.0, 100.0)
    assert M.read_model_file(model_file).timesteps == own != GeneratorConfig.timesteps
    out = tmp_path / "run"
    args = ["--smoke", "--device", "cpu", "--out", str(out), "--set", f"model={GROWN}"]
    assert main([*args, "--minutes", "5"]) == 0  # trains to the end
    assert main([*args, "--export", str(tmp_path / "f.safetensors"), "--timesteps", "1000,600,300"]) == 0
    path = str(tmp_path / "f.safetensors")
    assert M.read_model_file(path).timesteps == (1000.0, 600.0, 300.0)
    path = str(model_file)
    assert build_generator("tiny", weights=path).cfg.timesteps == own
    two = GeneratorConfig(timesteps=GeneratorConfig.timesteps[:2])  # what steps-2 makes of the default
    assert build_generator("tiny", weights=path, cfg=two).cfg.timesteps == own[:2]
    mine = GeneratorConfig(timesteps=(1000.0, 300.0))
    assert build_generator("tiny", weights=path, cfg=mine).cfg.timesteps == (1000.0, 300.0)


def test_vocabulary_words_take_the_stored_vectors_others_the_hashed_ones():
    words = ["red", "ball"]
    vectors = torch.arange(2 * 8, dtype=torch.float32).view(2, 8)
    enc, plain = VocabTextEncoder(8, 6, words, vectors), HashTextEncoder(8, 6)
    got, want = enc.encode(["red ball zebra"]), plain.encode(["red ball zebra"])
    assert torch.allclose(got[0, 0] - want[0, 0], vectors[0] - plain.word_vector("red"))
    assert torch.allclose(got[0, 1] - want[0, 1], vectors[1] - plain.word_vector("ball"))
    assert torch.equal(got[0, 2:], want[0, 2:])  # "zebra" and the padding: as before
    with pytest.raises(ValueError, match="do not fit 3 words"):
        VocabTextEncoder(8, 6, ["a", "b", "c"], vectors)


def test_which_weights_each_choice_means(monkeypatch, model_file, tmp_path, caplog):
    monkeypatch.setattr(M, "BUILTIN_WEIGHTS", model_file)
    assert M.resolve_weights("auto", "tiny") == model_file
    assert M.resolve_weights("builtin", "tiny") == model_file
    missing = tmp_path / "assets" / "tiny.safetensors"
    monkeypatch.setattr(M, "BUILTIN_WEIGHTS", missing)
    with caplog.at_level("WARNING", logger=M.__name__):
        assert M.resolve_weights("auto", "tiny") is None  # not installed: random weights, said in the log
    assert "is not in this install: random weights" in caplog.text
    assert M.resolve_weights("builtin", "tiny") == missing  # asked for by name: loading it is the clear error
    assert M.resolve_weights("auto", "tiny", checkpoint="sf.pt") is None  # a checkpoint's DiT, as before
    assert M.resolve_weights("auto", "tiny", wan_dir="wan") is None
    assert M.resolve_weights("auto", "wan2.1-1.3b") is None  # no built-in model for it: random, as before
    assert M.resolve_weights("random", "tiny") is None
    assert M.resolve_weights(None, "tiny") is None
    assert M.resolve_weights("runs/x.safetensors", "tiny") == Path("runs/x.safetensors")
    with pytest.raises(ValueError, match="random DiT weights, but a checkpoint was given too"):
        M.resolve_weights("random", "tiny", checkpoint="sf.pt")
    with pytest.raises(ValueError, match="whole model .* and a Wan folder was given too"):
        M.resolve_weights("builtin", "tiny", wan_dir="wan")
    with pytest.raises(ValueError, match="the tiny preset's, not 'wan2.1-1.3b'"):
        M.resolve_weights("builtin", "wan2.1-1.3b")
    with pytest.raises(ValueError, match="follow an input video themselves"):  # the separate file is gone
        M.resolve_weights("follow", "tiny")


def test_a_missing_or_foreign_file_is_a_clear_error(tmp_path, monkeypatch, model_file):
    monkeypatch.setattr(M, "BUILTIN_WEIGHTS", tmp_path / "assets" / "tiny.safetensors")
    with pytest.raises(W.CheckpointError, match="built-in model's weights are missing.*--weights random"):
        build_generator("tiny", weights="builtin")
    with pytest.raises(W.CheckpointError, match="does not exist"):
        build_generator("tiny", weights=str(tmp_path / "nope.safetensors"))
    dit_only = tmp_path / "dit.safetensors"
    W.save_checkpoint(build_generator("tiny").model, dit_only)
    with pytest.raises(W.CheckpointError, match="not a model file of `python -m models.train --export`"):
        build_generator("tiny", weights=str(dit_only))
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(W.CheckpointError, match="not a readable safetensors file"):
        build_generator("tiny", weights=str(tmp_path / "junk.safetensors"))
    with pytest.raises(W.CheckpointError, match="trained as the 'tiny' preset, not 'wan2.1-1.3b'"):
        build_generator("wan2.1-1.3b", weights=str(model_file))


def test_random_weights_are_still_one_flag_away():
    a, b = build_generator("tiny", weights="random", seed=0), build_generator("tiny", seed=0)
    assert type(a.text_encoder) is HashTextEncoder
    for (k, x), y in zip(a.model.state_dict().items(), b.model.state_dict().values()):
        assert torch.equal(x, y), k


# -- the shipped file ------------------------------------------------------------------------------


def test_the_built_in_weights_ship_as_package_data():
    assert M.BUILTIN_WEIGHTS == ROOT / "models" / "assets" / "tiny.safetensors"
    if M.BUILTIN_WEIGHTS.is_file():
        assert M.BUILTIN_WEIGHTS.stat().st_size < 5e6
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["models"]
    assert any(fnmatch("assets/tiny.safetensors", g) for g in globs)


def test_golden_vocabulary_vectors_of_the_built_in_model(model_file):
    """The stored vectors are the hashing encoder's for the caption words, so a prompt encodes the same from
    the file as from the hash; should hashing or torch's generator ever change, the model keeps its own."""
    path = M.BUILTIN_WEIGHTS if M.BUILTIN_WEIGHTS.is_file() else model_file  # the shipped file, once trained
    mf = M.read_model_file(path)
    assert list(mf.words) == vocabulary()
    plain = HashTextEncoder(mf.config.text_dim, mf.config.text_len)
    for word, vec in zip(mf.words, mf.vectors):
        assert torch.equal(vec, plain.word_vector(word)), word
    gen = build_generator("tiny", weights=str(path))
    prompts = ["a red ball moving right", "show me the little blue box, falling on a white background", "a cat"]
    assert torch.equal(gen.text_encoder.encode(prompts), plain.encode(prompts))
    assert mf.preset == mf.config.name == "tiny"
