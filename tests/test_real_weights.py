"""Real-weight files end to end, in the exact layouts users have, made small here: a Wan2.1 folder
(umT5 encoder + tokenizer, the VAE) and a Self-Forcing checkpoint, through `streamsvc generate`
and the engine's admission (the Wan VAE's per-stream cache counted with the KV cache)."""

import av
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from diffusers import AutoencoderKLWan  # noqa: E402
from transformers import UMT5Config, UMT5EncoderModel  # noqa: E402

from models import CausalWanModel, ModelConfig, build_generator  # noqa: E402
from models.umt5 import WAN_CHECKPOINT, WAN_TOKENIZER, wan_key_map  # noqa: E402
from models.wan_vae import WAN_VAE_FILE, diffusers_key_to_wan, wan21_vae_config  # noqa: E402
from streamsvc.cli import main  # noqa: E402
from tests.models.test_umt5 import make_tokenizer  # noqa: E402

TEXT_DIM = 32  # the tiny DiT's text input: the umT5 below is this wide


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """wan/ (Wan's original layout, no DiT of its own) and a Self-Forcing-style self_forcing_dmd.pt."""
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("weights")
    wan = root / "wan"
    t5 = UMT5EncoderModel(UMT5Config(vocab_size=64, d_model=TEXT_DIM, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                     relative_attention_num_buckets=32, feed_forward_proj="gated-gelu")).eval()
    own = t5.state_dict()
    wan.mkdir()
    torch.save({k: own[v[0]].clone() for k, v in wan_key_map(2).items()}, wan / WAN_CHECKPOINT)
    make_tokenizer().save_pretrained(str(wan / WAN_TOKENIZER))
    vae = AutoencoderKLWan(**wan21_vae_config(base_dim=8)).eval()
    torch.save({diffusers_key_to_wan(k): v.clone() for k, v in vae.state_dict().items()}, wan / WAN_VAE_FILE)
    dit = CausalWanModel(ModelConfig.from_name("tiny")).init_weights(1)
    other = CausalWanModel(ModelConfig.from_name("tiny")).init_weights(2)
    ckpt = root / "self_forcing_dmd.pt"
    torch.save({"generator_ema": {f"model.{k}": v for k, v in dit.state_dict().items()},
                "generator": {f"model.{k}": v for k, v in other.state_dict().items()}}, ckpt)
    return wan, ckpt, dit


def test_generator_from_a_wan_folder_and_a_self_forcing_checkpoint(files):
    wan, ckpt, dit = files
    gen = build_generator("tiny", checkpoint=str(ckpt), wan_dir=str(wan))
    assert type(gen.text_encoder).__name__ == "UMT5TextEncoder" and type(gen.decoder).__name__ == "WanVAEDecoder"
    for name, p in gen.model.state_dict().items():  # generator_ema's weights, not generator's
        if name in dit.state_dict():
            torch.testing.assert_close(p, dit.state_dict()[name])
    text = gen.text_encoder.encode(["a red cat runs"])
    assert text.shape == (1, gen.model_cfg.text_len, TEXT_DIM) and text[0, 5:].abs().sum() == 0 and text[0, 4].abs().sum() > 0  # the zero tail
    assert gen.decoder_state_bytes() > gen.cache_spec().stream_bytes() // 100  # the VAE's cache is counted
    with pytest.raises(ValueError, match="--wan-dir"):
        build_generator("tiny", checkpoint=str(ckpt), decoder="wan-vae")


def test_streamsvc_generate_with_real_weight_files(files, tmp_path, capsys):
    wan, ckpt, _ = files
    out = tmp_path / "out.mp4"
    code = main(["generate", "--prompt", "a red cat runs", "--prompt-at", "0.6:a blue boat at night", "--seconds", "1.3",
                 "--preset", "tiny", "--wan-dir", str(wan), "--checkpoint", str(ckpt), "--decoder", "wan-vae",
                 "--quiet", "-o", str(out)])
    assert code == 0, capsys.readouterr()
    with av.open(str(out)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == 21 and frames[0].shape == (128, 128, 3)  # 9 + 12 frames cover 1.3 s at 16 fps
    assert len({f.tobytes() for f in frames}) > 1


def test_a_missing_wan_folder_is_a_clear_error(tmp_path, capsys):
    code = main(["generate", "--prompt", "x", "--wan-dir", str(tmp_path / "nowhere"), "--quiet", "-o",
                 str(tmp_path / "o.mp4")])
    err = capsys.readouterr().err
    assert code == 2 and "streamsvc generate:" in err and "Traceback" not in err


def test_start_up_refuses_what_does_not_fit_the_gpu(monkeypatch):
    from models.generator import _check_free_memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * 2**30, 80 * 2**30))
    _check_free_memory("umT5", 3 * 2**30, torch.device("cuda"))  # fits: nothing said
    with pytest.raises(ValueError, match=r"umT5 needs about 11.0 GiB on cuda, which has 4.0 GiB free of 80.0"):
        _check_free_memory("umT5", 11 * 2**30, torch.device("cuda"))
    _check_free_memory("umT5", 11 * 2**30, torch.device("cpu"))  # the host: not checked
