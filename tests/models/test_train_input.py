"""The input adapter (models/train_input.py, models/model_file.py INPUT_ADAPTER): a smoke run trains on a mixed batch
and exports a LoRA that goes into a model file; a generator from that file runs its streams with an input under the
adapter (exactly as the same LoRA as a style), and every other stream on the base weights, bit for bit."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models import GeneratorConfig, WorkKind, build_generator
from models.model_file import BUILTIN_WEIGHTS, INPUT_ADAPTER, embed_input_adapter, read_model_file
from models.train_input import InputConfig, InputTrainer, main
from models.weights import CheckpointError

pytestmark = pytest.mark.skipif(not BUILTIN_WEIGHTS.is_file(), reason="the built-in model file is not in this checkout")
CPU = torch.device("cpu")
PROMPT = "a red ball moving right"


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory):
    """A smoke run's export with random B's (training starts them at zero), and the built-in file with it embedded."""
    tmp = tmp_path_factory.mktemp("input")
    trainer = InputTrainer(InputConfig.smoke(), tmp, CPU)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, b in trainer.pairs.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    lora = tmp / "input.safetensors"
    trainer.export(lora)
    return lora, embed_input_adapter(BUILTIN_WEIGHTS, lora, tmp / "tiny_input.safetensors", ["video", "image"])


@pytest.fixture(scope="module")
def base_file(tmp_path_factory):
    """The built-in model file without its input adapter."""
    with safe_open(str(BUILTIN_WEIGHTS), "pt") as f:
        meta = {k: v for k, v in (f.metadata() or {}).items() if not k.startswith(f"{INPUT_ADAPTER}.")}
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(f"{INPUT_ADAPTER}.")}
    path = tmp_path_factory.mktemp("base") / "tiny.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def frames_of(gen, state, chunks: int = 2) -> torch.Tensor:
    out = []
    for chunk in gen.stream(state, {}):
        out.append(chunk.frames)
        if len(out) == chunks:
            return torch.cat(out)


def test_a_smoke_run_trains_on_pairs_images_and_text_and_resumes(tmp_path, capsys):
    args = ["--smoke", "--out", str(tmp_path), "--device", "cpu", "--save-minutes", "0"]
    assert main(args + ["--minutes", "0"]) == 0
    assert "run again to resume" in capsys.readouterr().out
    assert main(args + ["--export", str(tmp_path / "a.safetensors"), "--embed", str(tmp_path / "m.safetensors")]) == 0
    assert len(read_model_file(tmp_path / "m.safetensors").input_adapter) == 21
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [(r["step"], r["chunk"]) for r in log] == [(1, 3), (2, 1)]
    with safe_open(str(tmp_path / "a.safetensors"), "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["style"] == INPUT_ADAPTER and json.loads(meta["lora_adapter_metadata"])["r"] == 16
    assert any(".head.head." in k for k in keys)  # blocks and the head


def test_the_mixed_batch_reaches_the_adapter_and_its_shares_are_checked():
    trainer = InputTrainer(InputConfig.smoke(), None, CPU)
    loss = trainer.step_loss(3)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [b.grad for _, b in trainer.pairs.values()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    for bad in ({"pair_share": 0.6, "image_share": 0.4}, {"pair_share": -0.1}, {"style": "invert"}, {"rank": 0}):
        with pytest.raises(ValueError):
            InputConfig(**bad)


def test_the_model_file_carries_the_adapter_and_refuses_a_broken_one(adapter_files, tmp_path):
    lora, model = adapter_files
    mf = read_model_file(model)
    assert len(mf.input_adapter) == 21 and {alpha for _, _, alpha in mf.input_adapter.values()} == {16.0}
    assert mf.input_kinds == ("video", "image")
    shipped = read_model_file(BUILTIN_WEIGHTS)  # the built-in file follows input video through its own adapter
    assert shipped.input_adapter and shipped.input_kinds == ("video",) and BUILTIN_WEIGHTS.stat().st_size < 5e6
    with safe_open(str(model), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    half = {k: v for k, v in tensors.items() if not k.endswith("blocks.0.ffn.0.lora_B.weight")}
    save_file(half, str(tmp_path / "half.safetensors"), metadata=meta)
    with pytest.raises(CheckpointError, match="input adapter is not a LoRA.*blocks.0.ffn.0 has no lora_B"):
        read_model_file(tmp_path / "half.safetensors")
    save_file(tensors, str(tmp_path / "noalpha.safetensors"), metadata={k: v for k, v in meta.items() if k != "input.alpha"})
    with pytest.raises(CheckpointError, match="input.alpha"):
        read_model_file(tmp_path / "noalpha.safetensors")


@pytest.mark.parametrize("nf", [3, 1])
def test_streams_with_an_input_run_under_the_adapter_and_the_others_on_the_base_weights(adapter_files, base_file, nf):
    lora, model = adapter_files
    cfg = GeneratorConfig(frames_per_chunk=nf)
    gen = build_generator("tiny", dtype=torch.float32, weights=str(model), cfg=cfg)
    plain = build_generator("tiny", dtype=torch.float32, weights=str(base_file), cfg=cfg)
    assert gen.input_adapter is not None and plain.input_adapter is None
    gen.adapters.load("same", lora)  # the adapter as a style: what the input stream must equal
    text = frames_of(gen, gen.open_stream("t", PROMPT, seed=1))
    assert torch.equal(text, frames_of(plain, plain.open_stream("t", PROMPT, seed=1)))  # bit for bit
    follows = frames_of(gen, gen.open_stream("i", PROMPT, seed=1, input_kind="video"))
    assert torch.equal(follows, frames_of(gen, gen.open_stream("s", PROMPT, seed=1, lora="same")))
    assert (follows.float() - text.float()).abs().mean() > 1  # the adapter does something
    # a style wins over the input adapter; the input stream on a model without one is a text stream
    styled = frames_of(gen, gen.open_stream("x", PROMPT, seed=1, lora="same", input_kind="video"))
    assert torch.equal(styled, follows)
    assert torch.equal(frames_of(plain, plain.open_stream("p", PROMPT, seed=1, input_kind="video")), text)
    with pytest.raises(ValueError, match="input_kind"):
        gen.open_stream("bad", PROMPT, seed=1, input_kind="camera")


def test_an_adapter_trained_without_image_clips_leaves_image_streams_on_the_base_weights(tmp_path):
    trainer = InputTrainer(InputConfig(steps=2, batch=3, image_share=0.0), None, CPU)
    with torch.no_grad():
        for _, b in trainer.pairs.values():
            b.fill_(0.05)
    trainer.export(tmp_path / "v.safetensors")
    model = embed_input_adapter(BUILTIN_WEIGHTS, tmp_path / "v.safetensors", tmp_path / "m.safetensors")
    assert read_model_file(model).input_kinds == ("video",)
    both = embed_input_adapter(BUILTIN_WEIGHTS, tmp_path / "v.safetensors", tmp_path / "b.safetensors", ["video", "image"])
    assert read_model_file(both).input_kinds == ("video", "image")
    with pytest.raises(CheckpointError, match="input.kinds"):
        embed_input_adapter(BUILTIN_WEIGHTS, tmp_path / "v.safetensors", both, ["camera"])
    assert read_model_file(both).input_kinds == ("video", "image") and not list(tmp_path.glob("*.tmp"))  # untouched
    gen = build_generator("tiny", dtype=torch.float32, weights=str(model))
    video = gen.lora_use(gen.open_stream("v", PROMPT, seed=1, input_kind="video"))
    assert video.adapter is gen.input_adapter
    assert gen.lora_use(gen.open_stream("w", PROMPT, seed=2, input_kind="video")) is video  # one product over their rows
    assert gen.lora_use(gen.open_stream("i", PROMPT, seed=1, input_kind="image")) is None


def test_in_one_batch_each_stream_runs_as_alone(adapter_files):
    _, model = adapter_files
    gen = build_generator("tiny", dtype=torch.float32, weights=str(model))
    alone = [frames_of(gen, gen.open_stream(f"a{i}", PROMPT, seed=i, input_kind="video" if i == 1 else None), chunks=1) for i in range(2)]
    states = [gen.open_stream(f"b{i}", PROMPT, seed=i, input_kind="video" if i == 1 else None) for i in range(2)]
    for _ in gen.sigmas:
        gen.run(WorkKind.DENOISE, states)
    chunks = gen.run(WorkKind.COMMIT, states)
    for i in range(2):
        torch.testing.assert_close(chunks[i].frames.float(), alone[i].float(), rtol=0, atol=1)
