import pytest
import torch

from models import CausalWanModel, CheckpointError, ModelConfig, load_checkpoint, save_checkpoint
from models.weights import read_state_dict


def tiny_model(seed: int) -> CausalWanModel:
    return CausalWanModel(ModelConfig.from_name("tiny")).init_weights(seed)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_round_trip(tmp_path, suffix):
    src, dst = tiny_model(1), tiny_model(2)
    path = tmp_path / f"dit{suffix}"
    save_checkpoint(src, path)
    load_checkpoint(dst, path)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name


def test_self_forcing_wrappers_and_prefix(tmp_path):
    src = tiny_model(3)
    wrapped = {"generator_ema": {f"model.{k}": v for k, v in src.state_dict().items()}, "step": torch.tensor(5)}
    torch.save(wrapped, tmp_path / "sf.pt")
    dst = load_checkpoint(tiny_model(4), tmp_path / "sf.pt")
    assert torch.equal(dst.head.head.weight, src.head.head.weight)
    plain = {"generator": {f"model.{k}": v for k, v in src.state_dict().items()}}
    torch.save(plain, tmp_path / "g.pt")
    assert set(read_state_dict(tmp_path / "g.pt")) == set(src.state_dict())


def test_wan_module_names():
    keys = set(tiny_model(0).state_dict())
    for k in [
        "patch_embedding.weight", "text_embedding.0.weight", "text_embedding.2.weight", "time_embedding.0.weight",
        "time_embedding.2.weight", "time_projection.1.weight", "blocks.0.self_attn.q.weight",
        "blocks.0.self_attn.norm_q.weight", "blocks.1.cross_attn.norm_k.weight", "blocks.0.norm3.weight",
        "blocks.0.ffn.0.weight", "blocks.0.ffn.2.bias", "blocks.0.modulation", "head.head.weight", "head.modulation",
    ]:
        assert k in keys, k


def test_clear_errors_name_the_keys(tmp_path):
    sd = dict(tiny_model(0).state_dict())
    del sd["blocks.1.ffn.0.weight"]
    sd["img_emb.proj.0.weight"] = torch.zeros(3)
    sd["head.head.weight"] = torch.zeros(7, 7)
    torch.save(sd, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tiny_model(0), tmp_path / "bad.pt")
    msg = str(e.value)
    assert "1 missing key(s): blocks.1.ffn.0.weight" in msg
    assert "1 unexpected key(s): img_emb.proj.0.weight" in msg
    assert "head.head.weight: checkpoint (7, 7) vs model (256, 64)" in msg
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tiny_model(0), tmp_path / "nope.safetensors")
    (tmp_path / "w.ckpt").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="expected .safetensors or .pt"):
        load_checkpoint(tiny_model(0), tmp_path / "w.ckpt")
