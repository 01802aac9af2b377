"""benchmarks/make_wan_files.py at --size tiny: every file it writes loads through the serving path
(Wan folder: umT5 + tokenizer, VAE, base DiT; Self-Forcing; LongLive base + LoRA; TAEHV) and a chunk
generates. CPU only, nothing downloaded."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("tokenizers")

from benchmarks.make_wan_files import WAN_DIR, main  # noqa: E402
from models import build_generator  # noqa: E402
from models.weights import read_lora, read_state_dict  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("wanfiles")
    assert main(["--out", str(out), "--size", "tiny", "--seed", "3", "--device", "cpu"]) == 0
    return out


def _weights(gen) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in gen.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k].float()) for k in b)


def test_manifest_lists_every_file(files, capsys):
    assert main(["--out", str(files / "again"), "--size", "tiny", "--seed", "3", "--device", "cpu"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    manifest = json.loads(line)["files"]
    for name in (f"{WAN_DIR}/models_t5_umt5-xxl-enc-bf16.pth", f"{WAN_DIR}/Wan2.1_VAE.pth", f"{WAN_DIR}/config.json",
                 f"{WAN_DIR}/diffusion_pytorch_model.safetensors", "self_forcing_dmd.pt", "longlive_base.pt",
                 "lora.pt", "taew2_1.pth"):
        assert manifest[name] == (files / "again" / name).stat().st_size > 0
    assert any(k.startswith(f"{WAN_DIR}/google/umt5-xxl/") for k in manifest)
    # the same seed writes the same tensors
    a = torch.load(files / "lora.pt", weights_only=True)["generator_lora"]
    b = torch.load(files / "again" / "lora.pt", weights_only=True)["generator_lora"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_self_forcing_and_the_wan_folder_load_and_generate(files):
    wan = files / WAN_DIR
    sd = torch.load(files / "self_forcing_dmd.pt", weights_only=True)
    assert sd["generator_ema"]["model.blocks.0.self_attn.q.weight"].dtype == torch.bfloat16
    ema = read_state_dict(files / "self_forcing_dmd.pt", "generator_ema")
    raw = read_state_dict(files / "self_forcing_dmd.pt", "generator")
    base = read_state_dict(wan)
    gen = build_generator("tiny", wan_dir=str(wan), checkpoint=str(files / "self_forcing_dmd.pt"))
    assert type(gen.text_encoder).__name__ == "UMT5TextEncoder" and type(gen.decoder).__name__ == "WanVAEDecoder"
    assert gen.text_encoder.tokenizer.pad_token_id == 0 and gen.text_encoder.tokenizer.eos_token_id == 1
    w = _weights(gen)
    assert _same(w, ema) and not _same(w, raw) and not _same(w, base)  # generator_ema's, not the others'
    state = gen.open_stream("s", "a red fox running through snow", seed=0)
    chunk = next(gen.stream(state))
    assert chunk.frames.shape == (9, 128, 128, 3) and chunk.frames.dtype == torch.uint8
    assert torch.isfinite(chunk.latents).all()
    text = gen.text_encoder.encode(["a red fox running through snow"])
    assert torch.isfinite(text).all() and text[0, :7].abs().sum() > 0 and text[0, 7:].abs().sum() == 0  # 6 words + </s>
    # the folder's own DiT, without a checkpoint
    assert _same(_weights(build_generator("tiny", wan_dir=str(wan))), base)


def test_longlive_base_and_lora_load_with_taehv(files):
    base = read_state_dict(files / "longlive_base.pt", "generator")
    pairs = read_lora(files / "lora.pt")
    assert len(pairs) == 2 * 10 and all(a.shape[0] == 4 for a, _ in pairs.values())
    gen = build_generator("tiny", wan_dir=str(files / WAN_DIR), checkpoint=str(files / "longlive_base.pt"),
                          wrapper="generator", lora=str(files / "lora.pt"), decoder="taehv",
                          taehv=str(files / "taew2_1.pth"))
    assert type(gen.decoder).__name__ == "TAEHVDecoder"
    w = _weights(gen)
    a, b = pairs["blocks.1.ffn.2"]
    merged = base["blocks.1.ffn.2.weight"].float() + b.float() @ a.float()  # merged in fp32 (the CPU model's dtype)
    torch.testing.assert_close(w["blocks.1.ffn.2.weight"], merged)
    assert not torch.equal(w["blocks.1.ffn.2.weight"], base["blocks.1.ffn.2.weight"].float())  # B is not zero
    assert torch.equal(w["head.head.weight"], base["head.head.weight"].float())
    chunk = next(gen.stream(gen.open_stream("s", "a blue boat at night", seed=1)))
    assert chunk.frames.shape == (9, 128, 128, 3)
